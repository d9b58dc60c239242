"""A short eager op loop to profile the client's per-op path (benchmark a. of bench_core.py).

Why: when the per-op number moves, a profile of the client says where the microseconds go:

    python benchmarks/op_loop.py [N] [--profile]   # --profile: cProfile of the timed loop only
    python -m cProfile -s cumtime benchmarks/op_loop.py [N]   # whole script, imports included

It uses an embedded local server (`rgpu.connect("local")`), warms the meta-inference cache, then
runs N (default 5000) `x = x + 1` on 16 floats and one `.item()`.
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time

import torch

import rgpu


def main() -> None:
    numbers = [a for a in sys.argv[1:] if a.isdigit()]
    n = int(numbers[0]) if numbers else 5000
    profile = cProfile.Profile() if "--profile" in sys.argv else None
    rgpu.connect("local")
    x = torch.zeros(16, device="rgpu")
    for _ in range(300):
        x = x + 1
    torch.rgpu.synchronize()  # type: ignore[attr-defined]
    before = rgpu.stats()
    t0 = time.perf_counter()
    if profile:
        profile.enable()
    for _ in range(n):
        x = x + 1
    x.sum().item()
    if profile:
        profile.disable()
    dt = time.perf_counter() - t0
    after = rgpu.stats()
    delta = {k: after[k] - before[k] for k in ("messages", "waits", "frames", "wait_seconds")}
    print(f"{dt / n * 1e6:.1f} us/op over {n} ops; {delta}", file=sys.stderr)
    rgpu.disconnect()
    if profile:
        pstats.Stats(profile, stream=sys.stdout).sort_stats("cumtime").print_stats(15)


if __name__ == "__main__":
    main()
