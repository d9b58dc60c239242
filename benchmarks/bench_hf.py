"""Hugging Face models on rgpu (issue 17): training steps and greedy decoding of real
`transformers` models against local CPU torch, and decoding over a 50 ms link.

Why: the repo's own models say little about what users run. This builds small models from
transformers' own classes (GPT-2; Llama with grouped-query attention; BERT with a padding mask;
ViT), trains each with AdamW on the CPU server and on local CPU torch, taking turns repeat by
repeat, and decodes greedily with the KV cache. Then it connects through `python -m rgpu.netem`
(its own process, 50 ms round trip) and measures tokens per second with the stop check running
ahead (`generate_lookahead`, the default) and checking every token (0), against the ideal of one
round trip per token: 1 / (RTT + local time per token). Decoding is also measured as
transformers' fast-generation recipe has it: a static cache and a compiled forward; training
also with the rgpu model under `torch.compile` (against the same eager CPU step).

    python benchmarks/bench_hf.py [--out FILE.json] [--repeats 5] [--rtt-ms 50]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from _common import Remote, cpu_delta, doc_header, emit, log, stats_delta, summary
from bench_core import start_server

import rgpu

transformers = __import__("transformers")
TARGET_TRAIN_RATIO = 1.6
TARGET_DECODE_RATIO = 2.5
TARGET_RTT_SPEEDUP = 2.0


def models() -> dict[str, Callable[[], tuple[torch.nn.Module, Callable[[str], dict]]]]:
    """name -> () -> (model, batch(device) -> the model's keyword arguments, with labels)."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 1000, (4, 32), generator=gen)
    mask = torch.ones(4, 32, dtype=torch.long)
    mask[1, 20:] = mask[3, 9:] = 0  # padding in two rows
    pixels = torch.randn(4, 3, 32, 32, generator=gen)
    classes = torch.randint(0, 10, (4,), generator=gen)

    def gpt2():
        cfg = transformers.GPT2Config(
            n_layer=4, n_embd=128, n_head=4, vocab_size=1000, n_positions=128
        )
        return transformers.GPT2LMHeadModel(cfg), lambda d: {
            "input_ids": ids.to(d), "labels": ids.to(d)}  # fmt: skip

    def llama():
        cfg = transformers.LlamaConfig(
            num_hidden_layers=4, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=256, vocab_size=1000, max_position_embeddings=128,
        )  # fmt: skip
        return transformers.LlamaForCausalLM(cfg), lambda d: {
            "input_ids": ids.to(d), "labels": ids.to(d)}  # fmt: skip

    def bert():
        cfg = transformers.BertConfig(
            num_hidden_layers=4, hidden_size=128, num_attention_heads=4, intermediate_size=256,
            vocab_size=1000, max_position_embeddings=128,
        )  # fmt: skip
        labels = ids.masked_fill(mask == 0, -100)
        return transformers.BertForMaskedLM(cfg), lambda d: {
            "input_ids": ids.to(d), "attention_mask": mask.to(d), "labels": labels.to(d)}  # fmt: skip

    def vit():
        cfg = transformers.ViTConfig(
            image_size=32, patch_size=8, num_hidden_layers=4, hidden_size=128, num_attention_heads=4,
            intermediate_size=256, num_labels=10,
        )  # fmt: skip
        return transformers.ViTForImageClassification(cfg), lambda d: {
            "pixel_values": pixels.to(d), "labels": classes.to(d)}  # fmt: skip

    return {"gpt2": gpt2, "llama": llama, "bert": bert, "vit": vit}


def train_step(
    model: torch.nn.Module, batch: Callable[[str], dict], device: str
) -> Callable[[], float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> float:
        opt.zero_grad()
        loss = model(**batch(device)).loss
        loss.backward()
        opt.step()
        return loss.item()

    return step


def bench_training(
    remote: Remote, name: str, make, steps: int, repeats: int, compiled: bool = False
) -> dict[str, Any]:
    """A training step on rgpu against the same eager step on local CPU torch; `compiled`:
    rgpu's model runs through `torch.compile(model, backend=rgpu.compile_backend())`, forward
    and backward each one shipped graph, and the CPU's stays eager (what a user compares)."""
    torch.manual_seed(0)
    cpu_model, batch = make()
    rgpu_model = copy.deepcopy(cpu_model).to("rgpu")
    cpu_model.train(), rgpu_model.train()
    local = train_step(cpu_model, batch, "cpu")
    run = torch.compile(rgpu_model, backend=rgpu.compile_backend()) if compiled else rgpu_model
    remote_step = train_step(run, batch, "rgpu")
    t0 = time.perf_counter()
    for _ in range(2):
        local(), remote_step()
    warm_s = time.perf_counter() - t0
    local_ms, remote_ms, deltas, cpu = [], [], [], []
    for r in range(repeats):
        for which in ("rgpu", "local") if r % 2 == 0 else ("local", "rgpu"):
            if which == "local":
                t0 = time.perf_counter()
                for _ in range(steps):
                    local()
                local_ms.append((time.perf_counter() - t0) / steps * 1e3)
                continue
            before, cpu0 = remote.stats(), remote.cpu_seconds()
            t0 = time.perf_counter()
            for _ in range(steps):
                remote_step()
            remote_ms.append((time.perf_counter() - t0) / steps * 1e3)
            cpu.append(cpu_delta(cpu0, remote.cpu_seconds(), steps / 1e3))
            deltas.append(stats_delta(before, remote.stats()))
    losses = (remote_step(), local())
    ratio = statistics.median(remote_ms) / statistics.median(local_ms)
    log(f"train {name}{' compiled' if compiled else ''}: rgpu {statistics.median(remote_ms):.1f} "
        f"ms, local {statistics.median(local_ms):.1f} ms, {ratio:.2f}x")  # fmt: skip
    return {
        "warm_up_s": warm_s,  # the first two steps (a compiled model compiles there)
        "rgpu_ms_per_step": summary(remote_ms),
        "local_ms_per_step": summary(local_ms),
        "ratio_of_medians": ratio,
        "messages_per_step": deltas[-1]["messages"] / steps,
        "waits_per_step": deltas[-1]["waits"] / steps,
        "client_cpu_ms_per_step": summary([c[0] for c in cpu]),
        "server_cpu_ms_per_step": summary([c[1] for c in cpu if c[1] is not None]),
        "final_loss_rgpu": losses[0],
        "final_loss_local": losses[1],
        "target_ratio": TARGET_TRAIN_RATIO,
        "meets_target": ratio <= TARGET_TRAIN_RATIO,
    }


PROMPT = torch.tensor([[5, 17, 3, 42, 8, 1, 77, 12]])
SHORT = 8  # tokens of the short generate whose time is the fixed cost of a call


def decode(
    model: torch.nn.Module, device: str, tokens: int, **kwargs: Any
) -> tuple[float, torch.Tensor]:
    t0 = time.perf_counter()
    out = model.generate(PROMPT.to(device), max_new_tokens=tokens, min_new_tokens=tokens,
                         do_sample=False, pad_token_id=0, **kwargs)  # fmt: skip
    out = out.cpu()
    return (time.perf_counter() - t0) / tokens * 1e3, out


def bench_decode(remote: Remote, name: str, make, tokens: int, repeats: int) -> dict[str, Any]:
    torch.manual_seed(0)
    cpu_model, _ = make()
    cpu_model.eval()
    rgpu_model = copy.deepcopy(cpu_model).to("rgpu")
    decode(cpu_model, "cpu", 4), decode(rgpu_model, "rgpu", 4)
    local_ms, remote_ms, deltas, cpu = [], [], [], []
    same = True
    for r in range(repeats):
        for which in ("rgpu", "local") if r % 2 == 0 else ("local", "rgpu"):
            if which == "local":
                ms, expected = decode(cpu_model, "cpu", tokens)
                local_ms.append(ms)
                continue
            before, cpu0 = remote.stats(), remote.cpu_seconds()
            ms, got = decode(rgpu_model, "rgpu", tokens)
            cpu.append(cpu_delta(cpu0, remote.cpu_seconds(), tokens / 1e3))
            deltas.append(stats_delta(before, remote.stats()))
            remote_ms.append(ms)
        same = same and torch.equal(got, expected)
    ratio = statistics.median(remote_ms) / statistics.median(local_ms)
    log(f"decode {name}: rgpu {statistics.median(remote_ms):.2f} ms/token, local "
        f"{statistics.median(local_ms):.2f}, {ratio:.2f}x, tokens equal: {same}")  # fmt: skip
    return _decode_result(tokens, remote_ms, local_ms, ratio, deltas, cpu, same)


def _decode_result(
    tokens: int,
    remote_ms: list[float],
    local_ms: list[float],
    ratio: float,
    deltas: list[dict[str, Any]],
    cpu: list[tuple[float, float | None]],
    same: bool,
    **extra: Any,
) -> dict[str, Any]:
    """One decoding benchmark's JSON: times, ratio to local CPU torch, counts per token."""
    return {
        "tokens": tokens,
        **extra,
        "rgpu_ms_per_token": summary(remote_ms),
        "local_ms_per_token": summary(local_ms),
        "ratio_of_medians": ratio,
        "messages_per_token": deltas[-1]["messages"] / tokens,
        "waits_per_token": deltas[-1]["waits"] / tokens,
        "client_cpu_ms_per_token": summary([c[0] for c in cpu]),
        "server_cpu_ms_per_token": summary([c[1] for c in cpu if c[1] is not None]),
        "tokens_equal_cpu": same,
        "target_ratio": TARGET_DECODE_RATIO,
        "meets_target": ratio <= TARGET_DECODE_RATIO,
    }


def bench_decode_compiled(
    remote: Remote, name: str, make, tokens: int, repeats: int
) -> dict[str, Any]:
    """transformers' fast-generation recipe: a static KV cache and a compiled forward (one CALL
    per decoded token for the model itself), against local CPU torch running the same static
    cache eagerly and its default (dynamic) cache."""
    torch.manual_seed(0)
    cpu_model, _ = make()
    cpu_model.eval()
    rgpu_model = copy.deepcopy(cpu_model).to("rgpu")
    rgpu_model.forward = torch.compile(
        rgpu_model.forward, backend=rgpu.compile_backend(), dynamic=False
    )
    static = {"cache_implementation": "static"}
    t0 = time.perf_counter()
    decode(rgpu_model, "rgpu", tokens, **static)  # compiles the prefill and the decode step
    first_call_s = time.perf_counter() - t0
    decode(cpu_model, "cpu", 4, **static)
    times: dict[str, list[float]] = {"rgpu": [], "local_static": [], "local_dynamic": []}
    deltas, cpu = [], []
    same = True
    for r in range(repeats):
        order = list(times) if r % 2 == 0 else list(reversed(times))
        for which in order:
            if which == "rgpu":
                before, cpu0 = remote.stats(), remote.cpu_seconds()
                ms, got = decode(rgpu_model, "rgpu", tokens, **static)
                cpu.append(cpu_delta(cpu0, remote.cpu_seconds(), tokens / 1e3))
                deltas.append(stats_delta(before, remote.stats()))
            elif which == "local_static":
                ms, expected = decode(cpu_model, "cpu", tokens, **static)
            else:
                ms, _ = decode(cpu_model, "cpu", tokens)
            times[which].append(ms)
        same = same and torch.equal(got, expected)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["rgpu"] / med["local_dynamic"]
    log(f"compiled decode {name}: rgpu {med['rgpu']:.2f} ms/token, local static "
        f"{med['local_static']:.2f}, local dynamic {med['local_dynamic']:.2f}, {ratio:.2f}x, "
        f"tokens equal: {same}")  # fmt: skip
    return _decode_result(
        tokens, times["rgpu"], times["local_dynamic"], ratio, deltas, cpu, same,
        first_call_s=first_call_s,
        local_static_ms_per_token=summary(times["local_static"]),
        ratio_to_local_static=med["rgpu"] / med["local_static"],
    )  # fmt: skip


def bench_rtt(
    url: str, name: str, make, tokens: int, repeats: int, rtt_ms: float
) -> dict[str, Any]:
    """Greedy decoding through a link emulator in its own process."""
    port = url.rsplit(":", 1)[1]
    netem = subprocess.Popen(
        [sys.executable, "-m", "rgpu.netem", "--target", f"127.0.0.1:{port}", "--listen", "0",
         "--rtt-ms", str(rtt_ms)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        line = netem.stdout.readline()
        slow_url = line.split()[1]
        rgpu.connect(slow_url)
        torch.manual_seed(0)
        cpu_model, _ = make()
        cpu_model.eval()
        rgpu_model = copy.deepcopy(cpu_model).to("rgpu")
        local_ms = statistics.median(decode(cpu_model, "cpu", tokens)[0] for _ in range(3))
        ideal = 1e3 / (rtt_ms + local_ms)  # tokens/s with one round trip per token
        rows: dict[str, Any] = {}
        for lookahead in (rgpu.settings.generate_lookahead, 0):
            saved = rgpu.settings.generate_lookahead
            rgpu.settings.generate_lookahead = lookahead
            try:
                decode(rgpu_model, "rgpu", 4)
                runs, marginal = [], []
                for _ in range(repeats):
                    before = rgpu.stats()
                    ms, _ = decode(rgpu_model, "rgpu", tokens)
                    runs.append((ms, stats_delta(before, rgpu.stats())))
                    short, _ = decode(rgpu_model, "rgpu", SHORT)
                    # per token past a generate call's fixed cost (its first waits, the last)
                    marginal.append((ms * tokens - short * SHORT) / (tokens - SHORT))
            finally:
                rgpu.settings.generate_lookahead = saved
            ms = statistics.median(r[0] for r in runs)
            per_token = statistics.median(marginal)
            rows[f"lookahead_{lookahead}"] = {
                "ms_per_token": summary([r[0] for r in runs]),
                "tokens_per_second": 1e3 / ms,
                "marginal_ms_per_token": summary(marginal),
                "marginal_tokens_per_second": 1e3 / per_token,
                "waits_per_token": runs[-1][1]["waits"] / tokens,
                "messages_per_token": runs[-1][1]["messages"] / tokens,
                "speedup_over_one_wait_per_token_ideal": 1e3 / per_token / ideal,
            }
            log(f"rtt {name} lookahead {lookahead}: {1e3 / ms:.1f} tokens/s for {tokens} tokens, "
                f"{1e3 / per_token:.1f} past the fixed cost (ideal one wait per token: "
                f"{ideal:.1f})")  # fmt: skip
        best = rows[f"lookahead_{rgpu.settings.generate_lookahead}"]
        return {
            "rtt_ms": rtt_ms,
            "tokens": tokens,
            "local_ms_per_token": local_ms,
            "one_wait_per_token_ideal_tokens_per_second": ideal,
            **rows,
            "target_speedup": TARGET_RTT_SPEEDUP,
            "meets_target": best["speedup_over_one_wait_per_token_ideal"] >= TARGET_RTT_SPEEDUP,
        }
    finally:
        rgpu.disconnect()
        netem.terminate()
        netem.wait(timeout=10)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Hugging Face models on rgpu (JSON on stdout)")
    p.add_argument("--out", help="also write the JSON document to this file")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rtt-ms", type=float, default=50.0)
    p.add_argument("--only", nargs="*", help="models to run (default: all)")
    p.add_argument(
        "--no-compiled", action="store_true",
        help="skip compiled training and compiled static-cache decode",
    )  # fmt: skip
    args = p.parse_args(argv)
    proc, url = start_server(None)
    try:
        session = rgpu.connect(url)
        doc: dict[str, Any] = {
            **doc_header("hf", f"rgpu {rgpu.__version__} (this repo)"),
            "server": {
                "url": url,
                "device_name": session.device_name,
                "torch": session.server_torch,
            },
            "transformers": transformers.__version__,
        }
        remote = Remote("rgpu", rgpu.stats, torch.rgpu.synchronize, server_pid=proc.pid)
        chosen = {k: v for k, v in models().items() if not args.only or k in args.only}
        doc["training"] = {
            n: bench_training(remote, n, m, args.steps, args.repeats) for n, m in chosen.items()
        }
        if not args.no_compiled:
            doc["training_compiled"] = {
                n: bench_training(remote, n, m, args.steps, args.repeats, compiled=True)
                for n, m in chosen.items()
            }
        doc["decode"] = {
            n: bench_decode(remote, n, m, args.tokens, args.repeats)
            for n, m in chosen.items() if n in ("gpt2", "llama")
        }  # fmt: skip
        if not args.no_compiled:
            doc["decode_compiled"] = {
                n: bench_decode_compiled(remote, n, m, args.tokens, args.repeats)
                for n, m in chosen.items() if n in ("gpt2", "llama")
            }  # fmt: skip
        rgpu.disconnect()
        doc["decode_over_a_slow_link"] = {
            n: bench_rtt(url, n, m, args.tokens, max(2, args.repeats // 2), args.rtt_ms)
            for n, m in chosen.items() if n in ("gpt2", "llama")
        }  # fmt: skip
        doc["machine"]["loadavg_at_end"] = os.getloadavg()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    emit(doc, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
