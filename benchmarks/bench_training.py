"""Training benchmark (issue 4): a small transformer LM trained on rgpu vs on local CPU torch.

Why: the point of a remote GPU is training. This measures what rgpu adds to a realistic step
(TinyLM: vocabulary 65, width 128, 4 heads, 4 layers, context 64, batch 8; AdamW; a fresh CPU
batch moved to the device each step; `loss.item()` every step) on a loopback CPU server, against
the same model and batches on plain CPU torch in the same process. The two take turns repeat by
repeat (the order flips each repeat), so the ratio survives this noisy shared 2-core machine.
Target: rgpu <= 2x local.

    python benchmarks/bench_training.py [--out FILE.json] [--pin] [--repeats 7]
    python benchmarks/bench_training.py --profile DIR   # cProfile of the client and the server

--pin puts the server on the last CPU and this client on the others, with one torch thread per
CPU on each side (the local baseline then has the client's CPUs). --profile runs the same steps
once under cProfile (client: DIR/client.prof; server: RGPU_SERVER_PROFILE=DIR, one file per
session) and prints the top functions; its timings are not comparable with a normal run.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import glob
import io
import os
import pstats
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

TARGET_RATIO = 2.0
LM = {"vocab": 65, "width": 128, "heads": 4, "layers": 4, "context": 64}
BATCH = 8


def make_lm_step(
    model: torch.nn.Module, device: str, batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> Callable[..., float]:
    """One AdamW step per call on the next batch (moved to `device`); reads the loss unless
    called with read=False (then it returns nan)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {"i": 0}

    def step(read: bool = True) -> float:
        x, y = batches[state["i"] % len(batches)]
        state["i"] += 1
        opt.zero_grad()
        _, loss = model(x.to(device), y.to(device))
        loss.backward()
        opt.step()
        return loss.item() if read else float("nan")

    return step


def lm_steps(seed: int = 0) -> tuple[Callable[..., float], Callable[..., float]]:
    """(rgpu step, local step): the same initial weights and the same batches."""
    torch.manual_seed(seed)
    cpu_model = TinyLM(**LM)
    gen = torch.Generator().manual_seed(seed + 1)
    batches = [lm_batch(LM["vocab"], BATCH, LM["context"], gen) for _ in range(16)]
    remote_model = copy.deepcopy(cpu_model).to("rgpu")
    return make_lm_step(remote_model, "rgpu", batches), make_lm_step(cpu_model, "cpu", batches)


def timed(step: Callable[..., float], steps: int) -> tuple[float, list[float]]:
    t0 = time.perf_counter()
    losses = [step() for _ in range(steps)]
    return (time.perf_counter() - t0) / steps * 1e3, losses


def bench_lm(remote: Remote, steps: int, warmup: int, repeats: int) -> dict[str, Any]:
    remote_step, local_step = lm_steps()
    for _ in range(warmup):
        remote_step()
        local_step()
    remote_ms: list[float] = []
    local_ms: list[float] = []
    deltas: list[dict[str, Any]] = []
    cpu: list[tuple[float, float | None]] = []
    for r in range(repeats):
        order = ("rgpu", "local") if r % 2 == 0 else ("local", "rgpu")
        for which in order:
            if which == "local":
                local_ms.append(timed(local_step, steps)[0])
                continue
            before, cpu0 = remote.stats(), remote.cpu_seconds()
            ms, _ = timed(remote_step, steps)
            cpu.append(cpu_delta(cpu0, remote.cpu_seconds(), steps / 1e3))
            deltas.append(stats_delta(before, remote.stats()))
            remote_ms.append(ms)
        log(f"lm {r}: rgpu {remote_ms[-1]:.1f} ms/step, local {local_ms[-1]:.1f} ms/step")
    # the two models saw the same batches in the same order: their losses must agree
    final_remote, final_local = remote_step(), local_step()
    loss_diff = abs(final_remote - final_local)
    med = statistics.median(remote_ms)
    ratios = [a / b for a, b in zip(remote_ms, local_ms)]
    per_step = {k: v / steps for k, v in deltas[-1].items()}
    return {
        "workload": f"TinyLM {LM}, batch {BATCH}, AdamW lr 1e-3, a fresh CPU batch moved to the "
        f"device each step, loss.item() every step; {repeats} repeats of {steps} steps after "
        f"{warmup} warm-up steps, rgpu and local taking turns",
        "parameters": sum(p.numel() for p in TinyLM(**LM).parameters()),
        "rgpu_ms_per_step": summary(remote_ms),
        "local_ms_per_step": summary(local_ms),
        "ratio_of_medians": med / statistics.median(local_ms),
        "ratio_of_mins": min(remote_ms) / min(local_ms),
        "ratio_per_repeat": summary(ratios),
        "per_step": per_step,  # messages, waits, bytes_out, bytes_in, frames, wait_seconds
        "messages_per_step_all_repeats": [d["messages"] / steps for d in deltas],
        "client_cpu_ms_per_step": summary([c[0] for c in cpu]),
        "server_cpu_ms_per_step": summary([c[1] for c in cpu if c[1] is not None]),
        "final_loss_rgpu": final_remote,
        "final_loss_local": final_local,
        "final_loss_abs_diff": loss_diff,
        "target_ratio": TARGET_RATIO,
        "meets_target": med / statistics.median(local_ms) <= TARGET_RATIO,
    }


def top(stats_file: str, n: int = 25) -> str:
    out = io.StringIO()
    pstats.Stats(stats_file, stream=out).strip_dirs().sort_stats("tottime").print_stats(n)
    return out.getvalue()


def profile_lm(steps: int, warmup: int, out_dir: str) -> dict[str, Any]:
    """The rgpu steps once under cProfile; the server profiles itself (RGPU_SERVER_PROFILE)."""
    remote_step, _ = lm_steps()
    for _ in range(warmup):
        remote_step()
    prof = cProfile.Profile()
    prof.enable()
    timed(remote_step, steps)
    prof.disable()
    path = os.path.join(out_dir, "client.prof")
    prof.dump_stats(path)
    return {"client_profile": path, "client_top_tottime": top(path)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="rgpu training benchmark (JSON on stdout)")
    p.add_argument("--out", help="also write the JSON document to this file")
    p.add_argument("--pin", action="store_true", help="server on the last CPU, client on the rest")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--profile", metavar="DIR", help="profile client and server into DIR instead")
    p.add_argument(
        "--server-env", action="append", default=[], metavar="K=V", help="server environment"
    )
    args = p.parse_args(argv)
    plan = pin_plan() if args.pin else None
    if args.pin and plan is None:
        p.error("--pin needs at least 2 CPUs")
    env = dict(kv.split("=", 1) for kv in args.server_env)
    if plan:
        pin_client(plan[0])
        torch.set_num_threads(len(plan[0]))
        env["OMP_NUM_THREADS"] = str(len(plan[1]))
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
        env["RGPU_SERVER_PROFILE"] = os.path.abspath(args.profile)
    proc, url = start_server(plan[1] if plan else None, env=env)
    try:
        session = rgpu.connect(url)
        log(f"connected to {url} ({session.device_name})")
        doc: dict[str, Any] = {
            **doc_header("training", f"rgpu {rgpu.__version__} (this repo)"),
            "server": {
                "url": url,
                "device_name": session.device_name,
                "torch": session.server_torch,
                "pinned": {"client": sorted(plan[0]), "server": sorted(plan[1])} if plan else None,
                "env": {k: v for k, v in env.items() if k != "RGPU_SERVER_PROFILE"},
            },
        }
        sync = torch.rgpu.synchronize  # type: ignore[attr-defined]
        remote = Remote("rgpu", rgpu.stats, sync, server_pid=proc.pid)
        if args.profile:
            doc["profile"] = profile_lm(args.steps, args.warmup, args.profile)
        else:
            doc["lm"] = bench_lm(remote, args.steps, args.warmup, args.repeats)
        doc["machine"]["loadavg_at_end"] = os.getloadavg()
        rgpu.disconnect()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    if args.profile:  # the server writes its profile when the session ends
        time.sleep(0.5)
        server_files = sorted(glob.glob(os.path.join(args.profile, "session-*.prof")))
        if server_files:
            doc["profile"]["server_profile"] = server_files[-1]
            doc["profile"]["server_top_tottime"] = top(server_files[-1])
    emit(doc, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
