"""Replayed steps (issue 17): a repeated op sequence sent op by op (plain RUNs) against the same
sequence replayed (DEFINE once, then one REPLAY message per `flush_ops` ops), and the local op.

Why: a training or decode step repeats the same ops; replaying it should cut the server's CPU per
op (target: replayed overhead, server CPU per op above the local op's own cost, at most a third
of the plain overhead) and the client's messages per step, with the same results. Plain and
replayed take turns repeat by repeat in one session (`rgpu.settings.replay` switched between
them; the learned sequences stay), next to the same work on local CPU torch, so the ratios
survive this noisy shared 2-core machine. Workloads: a loop of `x = x + 1` (server CPU per op),
TinyLM training with AdamW and dropout, and when transformers is installed a GPT-2 and a Llama
training step and greedy decoding.

    python benchmarks/bench_replay.py [--out FILE.json] [--repeats 5] [--steps 5] [--pin]

Counts are per step (per generate call for decoding) and include the synchronize that closes
each measured repeat (waits per step: 1 + 1 / steps).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from _common import (
    Remote,
    cpu_delta,
    doc_header,
    emit,
    log,
    pin_client,
    pin_plan,
    stats_delta,
    summary,
)
from bench_core import start_server

import rgpu
from rgpu.models import TinyLM, lm_batch

TARGET_OVERHEAD_RATIO = 1 / 3  # replayed server overhead per op over plain
MODES = ("plain", "replayed")


def _set(mode: str) -> None:
    rgpu.settings.replay = mode == "replayed"


def _measure(remote: Remote, run: Callable[[], Any], per: int) -> dict[str, Any]:
    """Run `run()` once: wall ms, client and server CPU ms, counters, all per `per` units."""
    remote.sync()
    before, cpu0 = remote.stats(), remote.cpu_seconds()
    t0 = time.perf_counter()
    value = run()
    remote.sync()
    wall = time.perf_counter() - t0
    client, server = cpu_delta(cpu0, remote.cpu_seconds(), per / 1e3)
    delta = stats_delta(before, remote.stats())
    return {"ms": wall / per * 1e3, "client_cpu_ms": client, "server_cpu_ms": server,
            "stats": delta, "value": value}  # fmt: skip


def _turns(
    remote: Remote, runs: dict[str, Callable[[], Any]], per: int, repeats: int
) -> dict[str, list[dict[str, Any]]]:
    """Each of `runs` once per repeat, the order flipping every repeat, after `torch.manual_seed`
    (unmeasured: dropout draws the same in every mode); "local" runs unmeasured by the remote
    counters (its own CPU time only)."""
    out: dict[str, list[dict[str, Any]]] = {k: [] for k in runs}
    names = list(runs)
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            torch.manual_seed(r)
            if name == "local":
                c0, t0 = time.process_time(), time.perf_counter()
                value = runs[name]()
                out[name].append({"ms": (time.perf_counter() - t0) / per * 1e3,
                                  "cpu_ms": (time.process_time() - c0) / per * 1e3,
                                  "value": value})  # fmt: skip
                continue
            _set(name)
            out[name].append(_measure(remote, runs[name], per))
        log(" ".join(f"{k} {v[-1]['ms']:.3f} ms" for k, v in out.items()))
    _set("replayed")
    return out


def _rows(turns: dict[str, list[dict[str, Any]]], unit: str, per: int) -> dict[str, Any]:
    """Per mode: every repeat's numbers per `unit` (`per` units a repeat), and the counters of
    its last repeat (whole)."""
    rows: dict[str, Any] = {}
    for mode in MODES:
        runs = turns[mode]
        rows[mode] = {
            f"ms_per_{unit}": summary([r["ms"] for r in runs]),
            f"client_cpu_ms_per_{unit}": summary([r["client_cpu_ms"] for r in runs]),
            f"server_cpu_ms_per_{unit}": summary([r["server_cpu_ms"] for r in runs]),
            **{
                f"{k}_per_{unit}": [r["stats"][k] / per for r in runs]
                for k in ("messages", "waits", "replayed_ops")
            },
            "stats_last_repeat": runs[-1]["stats"],
        }
    return rows


def _ratios(rows: dict[str, Any], unit: str) -> dict[str, float]:
    p, r = rows["plain"], rows["replayed"]
    med = statistics.median
    return {
        f"client_cpu_{unit}_replayed_over_plain": med(r[f"client_cpu_ms_per_{unit}"]["all"])
        / med(p[f"client_cpu_ms_per_{unit}"]["all"]),
        f"server_cpu_{unit}_replayed_over_plain": med(r[f"server_cpu_ms_per_{unit}"]["all"])
        / med(p[f"server_cpu_ms_per_{unit}"]["all"]),
        f"messages_{unit}_replayed_over_plain": r[f"messages_per_{unit}"][-1]
        / p[f"messages_per_{unit}"][-1],
    }


# -- a. server CPU per op --------------------------------------------------------------------


def bench_per_op(remote: Remote, ops: int, steps: int, repeats: int) -> dict[str, Any]:
    """`steps` steps of `ops` x `x = x + 1` on 16 floats, each ending in a synchronize."""
    x0 = torch.zeros(16)
    dev = {m: x0.to("rgpu") for m in MODES}

    def loop(mode: str) -> Callable[[], float]:
        def run() -> float:
            x = dev[mode] if mode != "local" else x0
            for _ in range(steps):
                for _ in range(ops):
                    x = x + 1
                if mode != "local":
                    torch.rgpu.synchronize()
            return float(x.sum().item()) if mode == "local" else 0.0

        return run

    for mode in MODES:  # warm: meta cache; the replayed side learns its sequence
        _set(mode)
        for _ in range(3):
            loop(mode)()
    n = ops * steps
    turns = _turns(remote, {m: loop(m) for m in (*MODES, "local")}, n, repeats)
    rows = _rows(turns, "op", n)
    local_us = statistics.median(r["cpu_ms"] for r in turns["local"]) * 1e3
    out: dict[str, Any] = {
        "workload": f"{steps} steps of {ops} x `x = x + 1` on torch.zeros(16) float32, each "
        "ending in torch.rgpu.synchronize()",
        "local_cpu_us_per_op": summary([r["cpu_ms"] * 1e3 for r in turns["local"]]),
    }
    for mode in MODES:
        server_us = statistics.median(rows[mode]["server_cpu_ms_per_op"]["all"]) * 1e3
        out[mode] = {
            "server_cpu_us_per_op": summary(
                [v * 1e3 for v in rows[mode]["server_cpu_ms_per_op"]["all"]]),
            "client_cpu_us_per_op": summary(
                [v * 1e3 for v in rows[mode]["client_cpu_ms_per_op"]["all"]]),
            "wall_us_per_op": summary([v * 1e3 for v in rows[mode]["ms_per_op"]["all"]]),
            "server_overhead_us_per_op": server_us - local_us,
            "messages_per_op": rows[mode]["messages_per_op"][-1],
            "stats_last_repeat": rows[mode]["stats_last_repeat"],
        }  # fmt: skip
    ratio = out["replayed"]["server_overhead_us_per_op"] / out["plain"]["server_overhead_us_per_op"]
    out.update({
        "server_cpu_replayed_over_plain": out["replayed"]["server_cpu_us_per_op"]["median"]
        / out["plain"]["server_cpu_us_per_op"]["median"],
        "server_overhead_replayed_over_plain": ratio,
        "target_overhead_ratio": TARGET_OVERHEAD_RATIO,
        "meets_target": ratio <= TARGET_OVERHEAD_RATIO,
    })  # fmt: skip
    log(f"per op: server plain {out['plain']['server_cpu_us_per_op']['median']:.1f} us, "
        f"replayed {out['replayed']['server_cpu_us_per_op']['median']:.1f} us, local "
        f"{local_us:.2f} us; overhead ratio {ratio:.2f}")  # fmt: skip
    return out


# -- b. training and decoding ------------------------------------------------------------------


def bench_steps(
    remote: Remote, make: Callable[[str], Callable[[], float]], steps: int, repeats: int,
    unit: str = "step",
) -> dict[str, Any]:  # fmt: skip
    """`make(device)` -> a step function returning what it read (a loss, tokens); each mode
    gets its own copy of the model, and the plain and replayed results are compared."""
    step = {m: make("rgpu") for m in MODES}
    step["local"] = make("cpu")
    for mode in MODES:
        _set(mode)
        torch.manual_seed(0)
        for _ in range(3):
            step[mode]()

    def run(mode: str) -> Callable[[], list]:
        return lambda: [step[mode]() for _ in range(steps)]

    turns = _turns(remote, {m: run(m) for m in (*MODES, "local")}, steps, repeats)
    rows = _rows(turns, unit, steps)
    same = all(a["value"] == b["value"] for a, b in zip(turns["plain"], turns["replayed"]))
    return {
        **rows,
        "local": {f"ms_per_{unit}": summary([r["ms"] for r in turns["local"]])},
        **_ratios(rows, unit),
        "plain_and_replayed_read_the_same": same,
    }


def lm_maker(dropout: float) -> Callable[[str], Callable[[], float]]:
    torch.manual_seed(0)
    base = TinyLM(vocab=65, width=64, heads=4, layers=2, context=32, dropout=dropout)

    def make(device: str) -> Callable[[], float]:
        model = copy.deepcopy(base).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        gen = torch.Generator().manual_seed(1)

        def step() -> float:
            x, y = lm_batch(65, 8, 32, gen)
            opt.zero_grad()
            _, loss = model(x.to(device), y.to(device))
            loss.backward()
            opt.step()
            return loss.item()

        return step

    return make


def hf_makers() -> dict[str, Any]:
    try:
        from bench_hf import PROMPT, models, train_step
    except ImportError:
        return {}
    out: dict[str, Any] = {}
    for name, build in models().items():
        if name not in ("gpt2", "llama"):
            continue
        torch.manual_seed(0)
        model, batch = build()

        def train(device: str, model=model, batch=batch) -> Callable[[], float]:
            m = copy.deepcopy(model).to(device)
            m.train()
            return train_step(m, batch, device)

        def decode(device: str, model=model, tokens: int = 16) -> Callable[[], list]:
            m = copy.deepcopy(model).to(device).eval()
            prompt = PROMPT.to(device)
            return lambda: m.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens,
                                      do_sample=False, pad_token_id=0).cpu().tolist()  # fmt: skip

        out[name] = (train, decode)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="replayed steps against plain RUNs (JSON on stdout)")
    p.add_argument("--out", help="also write the JSON document to this file")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=5, help="training steps per repeat")
    p.add_argument("--pin", action="store_true", help="server on the last CPU, client on the rest")
    args = p.parse_args(argv)
    plan = pin_plan() if args.pin else None
    if plan:
        pin_client(plan[0])
    proc, url = start_server(plan[1] if plan else None)
    try:
        session = rgpu.connect(url)
        doc: dict[str, Any] = {
            **doc_header("replay", f"rgpu {rgpu.__version__} (this repo)"),
            "server": {
                "url": url,
                "device_name": session.device_name,
                "torch": session.server_torch,
                "pinned": bool(plan),
            },  # fmt: skip
            "flush_ops": session.config.flush_ops,
        }
        remote = Remote("rgpu", rgpu.stats, torch.rgpu.synchronize, server_pid=proc.pid)
        doc["per_op"] = bench_per_op(remote, ops=500, steps=10, repeats=args.repeats)
        doc["training"] = {"tinylm_adamw_dropout": bench_steps(
            remote, lm_maker(0.1), args.steps, args.repeats)}  # fmt: skip
        doc["decode"] = {}
        for name, (train, decode) in hf_makers().items():
            doc["training"][name] = bench_steps(remote, train, args.steps, args.repeats)
            doc["decode"][name] = bench_steps(remote, decode, 1, args.repeats, unit="call")
            doc["decode"][name]["tokens_per_call"] = 16
        for group in ("training", "decode"):
            for name, r in doc[group].items():
                log(f"{group} {name}: " + ", ".join(
                    f"{k} {v:.2f}" for k, v in r.items() if k.endswith("_over_plain")))  # fmt: skip
        doc["machine"]["loadavg_at_end"] = os.getloadavg()
        rgpu.disconnect()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    emit(doc, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
