"""Several devices benchmark (issue 18): DistributedDataParallel on 1, 2 and 4 rgpu devices, and
copies between devices against a copy on one device.

Why: past one GPU the questions are whether the collectives stay on the server (the bytes through
each client per step must not grow with the gradients) and what a copy between devices costs.

* DDP: one `rgpu-server --device cpu --virtual-devices 4`; 1, 2 and 4 rank processes (started as
  torchrun starts them, tests/ddp_worker.py: an MLP of 16-256-256-4, SGD with momentum, a global
  batch of 32 split across the ranks, `loss.item()` every step) on rgpu:0..N-1 with the "rgpu"
  c10d backend (the server's gloo), each size in 3 jobs taking turns. Per step: wall time (the
  slowest rank's; the first two steps, DDP's set-up, left out), messages, waits, bytes out and in
  per client, next to the gradient bytes a client-side all-reduce would move. All processes
  share this 2-core machine, so the step time shows overhead and contention, not a speed-up.
* Copies: a 64 MiB float32 tensor copied on its device (`clone`), to another virtual device of
  the same server (`.to("rgpu:1")`), and to a second server (`.to("rgpu:2")`: EXPORT/IMPORT over
  loopback), taking turns repeat by repeat; each timed to the destination's synchronize.

    python benchmarks/bench_devices.py [--out FILE.json] [--steps 12] [--rounds 3] [--repeats 5]
    (on a GPU host: --device cuda measures the same with NCCL and real GPUs)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
from _common import doc_header, emit, log, summary
from bench_core import start_server

import rgpu

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from ddp_worker import launch, model  # noqa: E402  (the DDP rank, shared with tests/test_ddp.py)

COPY_BYTES = 64 << 20


def bench_ddp(url: str, worlds: list[int], steps: int, rounds: int) -> dict[str, Any]:
    """Each world size `rounds` times, the order flipping each round (the load on this shared
    machine drifts); per world, the steps of all its rounds together."""
    grads = sum(p.numel() * p.element_size() for p in model().parameters())
    out: dict[str, Any] = {"gradient_bytes": grads, "steps": steps, "rounds": rounds, "worlds": {}}
    runs: dict[int, list[list[dict]]] = {w: [] for w in worlds}
    for r in range(rounds):
        for world in worlds if r % 2 == 0 else list(reversed(worlds)):
            with tempfile.TemporaryDirectory() as tmp:
                runs[world].append(launch(url, world, steps, tmp))
    for world, jobs in runs.items():
        per_step = [max(rank["times"][i] for rank in ranks) * 1e3
                    for ranks in jobs for i in range(2, steps)]  # fmt: skip
        counted = [s for ranks in jobs for rank in ranks for s in rank["stats"][2:]]
        mean = {k: statistics.mean(s[k] for s in counted) for k in counted[0]}
        out["worlds"][str(world)] = {
            "ms_per_step": summary(per_step),
            "per_client_per_step": mean,
            "gradient_bytes_through_clients": (mean["bytes_in"] + mean["bytes_out"]) >= grads,
            "server_backend": jobs[0][0]["backend"],
            "final_loss": statistics.mean(rank["losses"][-1] for rank in jobs[0]),
        }
        log(f"DDP on {world} device(s): {statistics.median(per_step):.1f} ms/step, "
            f"{mean['bytes_out']:.0f} B out, {mean['bytes_in']:.0f} B in per client per step "
            f"(gradients: {grads} B)")  # fmt: skip
    return out


def _timed(fn: Any, sync: Any) -> float:
    t0 = time.perf_counter()
    out = fn()
    sync()
    elapsed = time.perf_counter() - t0
    del out
    return elapsed


def bench_copies(url_a: str, url_b: str, repeats: int) -> dict[str, Any]:
    rgpu.connect([url_a, url_b])  # A's devices first, then B's
    try:
        on_a = sum(d["server"] == rgpu.current_session().url for d in rgpu.device_list())
        x = torch.randn(COPY_BYTES // 4, device="rgpu:0")
        torch.rgpu.synchronize(0)

        def to(i: int) -> tuple:
            return (lambda: x.to(f"rgpu:{i}"), lambda: torch.rgpu.synchronize(i))

        cases = {"same_device": (lambda: x.clone(), lambda: torch.rgpu.synchronize(0))}
        if on_a > 1:
            cases["other_device_same_server"] = to(1)
        cases["other_server"] = to(on_a)
        for fn, sync in cases.values():  # warm up each path once
            _timed(fn, sync)
        seconds: dict[str, list[float]] = {k: [] for k in cases}
        client: dict[str, dict[str, int]] = {}
        for rep in range(repeats):
            order = list(cases) if rep % 2 == 0 else list(reversed(cases))
            for name in order:
                before = rgpu.stats()
                seconds[name].append(_timed(*cases[name]))
                after = rgpu.stats()
                client[name] = {k: after[k] - before[k] for k in ("bytes_out", "bytes_in")}
        out = {
            "bytes": COPY_BYTES,
            "MBps": {k: summary([COPY_BYTES / s / 1e6 for s in v]) for k, v in seconds.items()},
            "client_bytes_per_copy": client,
        }
        for k, v in out["MBps"].items():
            log(f"copy {k}: {v['median']:,.0f} MB/s")
        return out
    finally:
        rgpu.disconnect()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--repeats", type=int, default=5, help="copies of each kind")
    p.add_argument("--rounds", type=int, default=3, help="DDP jobs of each size")
    p.add_argument("--device", default="cpu", help="cpu (4 virtual devices) or cuda (every GPU)")
    args = p.parse_args(argv)
    doc = doc_header("devices", "rgpu (this repo)")
    flags = ["--virtual-devices", "4"] if args.device == "cpu" else []
    server, url = start_server(None, [*flags, "--device", args.device])
    second, url_b = start_server(None, ["--device", args.device])
    try:
        worlds = (
            [1, 2, 4] if args.device == "cpu" else list(range(1, torch.cuda.device_count() + 1))
        )
        doc["ddp"] = bench_ddp(url, worlds, args.steps, args.rounds)
        doc["copies"] = bench_copies(url, url_b, args.repeats)
    finally:
        for proc in (server, second):
            proc.terminate()
            proc.wait(30)
    emit(doc, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
