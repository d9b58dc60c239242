"""Step time against round-trip latency (issue 7): the TinyLM of bench_training.py through an
emulated link (rgpu.netem) at several RTTs, in three ways of writing the training loop:

* ``item``: eager, ``loss.item()`` every step (one wait per step: a round trip each);
* ``nonblocking``: eager, the loss logged with ``loss.to("cpu", non_blocking=True)`` and read after
  one ``torch.rgpu.synchronize()`` at the end of the run (no wait per step);
* ``compiled``: ``torch.compile(model, backend=rgpu.compile_backend())``, logged the same
  non-blocking way.

Each point is `steps` steps after a warm-up, ending with a synchronize, so a step's time includes
its share of the final drain. The ideal line is compute + waits x RTT: the mode's own step time
over the same emulator at 0 ms plus its measured waits per step times the RTT. The published
rgpu 0.1.1 runs the ``item`` loop the same way where it can (``--published``, in its virtualenv).

    python benchmarks/bench_latency.py [--rtts 0,10,50,120] [--steps 20] [--out FILE.json]
    /tmp/anchor-venv/bin/python benchmarks/bench_latency.py --published [--out FILE.json]

Op-stream compression at 10 Mbit/s: ``--compression`` runs the ``item`` loop through a 10 Mbit/s
link (RTT 0 and 50 ms) with RGPU_COMPRESS=0 and =1, and reports bytes on the wire and step time.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import doc_header, emit, log  # noqa: E402


def _load(name: str, path: Path) -> Any:
    """A module of this repo loaded by path: the published rgpu's virtualenv has its own `rgpu`."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


class Link:
    """rgpu.netem in its own process, as a real link is: in this process its thread would wait
    for the GIL behind the thread issuing ops, delaying deliveries beyond the emulated RTT."""

    def __init__(self, target_port: int, rtt_ms: float = 0.0, mbit: float | None = None) -> None:
        cmd = [sys.executable, str(REPO / "rgpu" / "netem.py"), "--target",
               f"127.0.0.1:{target_port}", "--listen", "0", "--rtt-ms", str(rtt_ms),
               "--control-stdin", *(["--mbit", str(mbit)] if mbit else [])]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()  # "rgpu.netem: ws://127.0.0.1:PORT -> ..."
        self.url = line.split()[1]
        self.port = int(self.url.rsplit(":", 1)[1])

    def set_rtt(self, rtt_ms: float) -> None:
        self.proc.stdin.write(f"{rtt_ms}\n")
        self.proc.stdin.flush()
        self.proc.stdout.readline()  # the acknowledgement: the new RTT is in force

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


models = _load("rgpu_bench_models", REPO / "rgpu" / "models.py")

LM = {"vocab": 65, "width": 128, "heads": 4, "layers": 4, "context": 64}  # as bench_training.py
BATCH = 8
MODES = ("item", "nonblocking", "compiled")


def make_loop(mode: str, device: str, rgpu: Any, seed: int = 0) -> Callable[[int], list[float]]:
    """A function that runs n training steps and returns their losses (read at the end for the
    non-blocking modes, so nothing waits per step)."""
    torch.manual_seed(seed)
    model = models.TinyLM(**LM).to(device)
    gen = torch.Generator().manual_seed(seed + 1)
    batches = [models.lm_batch(LM["vocab"], BATCH, LM["context"], gen) for _ in range(8)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    forward = model
    if mode == "compiled":
        forward = torch.compile(model, backend=rgpu.compile_backend(), dynamic=False)
    state = {"i": 0}

    def run(n: int) -> list[float]:
        logged: list[Any] = []
        for _ in range(n):
            x, y = batches[state["i"] % len(batches)]
            state["i"] += 1
            opt.zero_grad(set_to_none=True)
            _, loss = forward(x.to(device), y.to(device))
            loss.backward()
            opt.step()
            if mode == "item":
                logged.append(loss.item())
            else:
                logged.append(loss.detach().to("cpu", non_blocking=True))
        if mode != "item":
            torch.rgpu.synchronize()  # type: ignore[attr-defined]
            return [float(t) for t in logged]
        return logged

    return run


def measure(
    run: Callable[[int], list[float]], stats: Callable[[], dict], steps: int, warmup: int = 3
) -> dict:
    run(warmup)  # first-step allocations, compiles, optimizer state
    before = stats()
    t0 = time.perf_counter()
    losses = run(steps)
    seconds = time.perf_counter() - t0
    after = stats()
    delta = {k: (after[k] - before.get(k, 0)) / steps for k in ("messages", "waits")}
    for k in ("bytes_out", "bytes_in"):
        if k in after:
            delta[k] = (after[k] - before.get(k, 0)) / steps
    return {"ms_per_step": seconds / steps * 1e3, "per_step": delta, "last_loss": losses[-1]}


def sweep_ours(rtts: list[float], steps: int, modes: tuple[str, ...]) -> dict[str, Any]:
    from bench_core import start_server

    import rgpu

    proc, url = start_server(None)
    port = int(url.rsplit(":", 1)[1])
    results: dict[str, list[dict]] = {m: [] for m in modes}
    try:
        for rtt_ms in rtts:
            link = Link(port, rtt_ms)
            try:
                session = rgpu.connect(link.url)
                for mode in modes:
                    point = measure(make_loop(mode, "rgpu", rgpu), rgpu.stats, steps)
                    point.update(rtt_ms=rtt_ms, link_rtt_ms=session.link.rtt_s * 1e3)
                    results[mode].append(point)
                    log(f"rgpu {mode:11s} RTT {rtt_ms:5.0f} ms: {point['ms_per_step']:7.1f} "
                        f"ms/step, {point['per_step']['waits']:.2f} waits/step")  # fmt: skip
                rgpu.disconnect()
            finally:
                link.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return {"server": url, "modes": results, **_verdicts(results)}


def _verdicts(results: dict[str, list[dict]]) -> dict[str, Any]:
    """Ideal lines and the issue's targets at 50 ms."""
    out: dict[str, Any] = {"ideal": {}, "targets_at_50ms": {}}
    for mode, points in results.items():
        base = next((p for p in points if p["rtt_ms"] == 0), None)
        if base is None:
            continue
        out["ideal"][mode] = [
            base["ms_per_step"] + p["per_step"]["waits"] * p["rtt_ms"] for p in points
        ]
        at50 = next((p for p in points if p["rtt_ms"] == 50), None)
        if at50 is None:
            continue
        if mode == "item":
            limit = base["ms_per_step"] + 1.1 * 50
            rule = "<= its 0 ms time + 1.1 x RTT"
        else:
            limit = 1.1 * base["ms_per_step"]
            rule = "<= 1.1 x its 0 ms time"
        out["targets_at_50ms"][mode] = {
            "rule": rule,
            "ms_per_step": at50["ms_per_step"],
            "limit_ms": limit,
            "met": at50["ms_per_step"] <= limit,
        }
    return out


def sweep_published(rtts: list[float], steps: int) -> dict[str, Any]:
    """rgpu 0.1.1: the `item` loop (it has no non-blocking readback and no graph shipping).
    It waits for many round trips per step, so a point gets 1 warm-up step and `steps` steps."""
    import importlib.metadata

    from bench_published import free_port, start_opserver

    import rgpu

    if Path(rgpu.__file__).resolve().is_relative_to(REPO):
        raise SystemExit("this is the repo's rgpu; run --published with the published rgpu's venv")
    port = free_port()
    proc = start_opserver(port, None)
    points: list[dict] = []
    error = None
    # one link for every point, its latency changed in between: rgpu 0.1.1 keeps the address it
    # first connected to
    link = Link(port)
    os.environ["RGPU_OPSERVER"] = f"127.0.0.1:{link.port}"
    try:
        for rtt_ms in rtts:
            link.set_rtt(rtt_ms)
            try:
                t0 = time.perf_counter()
                point = measure(make_loop("item", "rgpu", rgpu), rgpu.stats, steps, warmup=1)
                point["rtt_ms"] = rtt_ms
                point["seconds"] = time.perf_counter() - t0
                points.append(point)
                log(f"rgpu 0.1.1 item RTT {rtt_ms:5.0f} ms: {point['ms_per_step']:7.1f} ms/step")
            except Exception as e:  # it cannot run the workload: say so, with the reason
                error = f"{type(e).__name__}: {e}"
                log(f"rgpu 0.1.1 failed at RTT {rtt_ms} ms: {error}\n{traceback.format_exc()}")
                break
    finally:
        link.close()
        proc.terminate()
        proc.wait(timeout=30)
    return {"version": importlib.metadata.version("rgpu"), "item": points, "error": error}


def compression_at_10mbit(steps: int) -> list[dict]:
    """The `item` loop over a 10 Mbit/s link, op-stream compression off and on."""
    from bench_core import start_server

    import rgpu

    proc, url = start_server(None)
    port = int(url.rsplit(":", 1)[1])
    rows = []
    try:
        for rtt_ms in (0, 50):
            for setting in ("0", "1"):
                os.environ["RGPU_COMPRESS"] = setting
                link = Link(port, rtt_ms, mbit=10)
                try:
                    rgpu.connect(link.url)
                    point = measure(make_loop("item", "rgpu", rgpu), rgpu.stats, steps)
                    stats = rgpu.stats()
                    point.update(
                        rtt_ms=rtt_ms,
                        compress=setting == "1",
                        compressed_frames=stats["compressed_frames"],
                        compression_saved=stats["compression_saved"],
                    )
                    rows.append(point)
                    log(f"10 Mbit/s RTT {rtt_ms} ms RGPU_COMPRESS={setting}: "
                        f"{point['ms_per_step']:.1f} ms/step, "
                        f"{point['per_step']['bytes_out'] / 1e3:.1f} kB out/step")  # fmt: skip
                    rgpu.disconnect()
                finally:
                    link.close()
    finally:
        os.environ.pop("RGPU_COMPRESS", None)
        proc.terminate()
        proc.wait(timeout=30)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="step time against RTT (JSON on stdout)")
    p.add_argument("--out", help="also write the JSON document to this file")
    p.add_argument("--rtts", default="0,10,50,120", help="round trips to emulate, ms")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--published", action="store_true", help="measure rgpu 0.1.1 (its venv)")
    p.add_argument("--compression", action="store_true", help="also the 10 Mbit/s comparison")
    args = p.parse_args(argv)
    rtts = [float(r) for r in args.rtts.split(",")]
    client = "rgpu 0.1.1 (PyPI)" if args.published else "rgpu (this repo)"
    doc: dict[str, Any] = {
        **doc_header("latency", client),
        "workload": f"TinyLM {LM}, batch {BATCH}, AdamW; {args.steps} steps per point after 3 "
        "warm-up steps, ending with a synchronize; every point goes through rgpu.netem, run as its own process",
    }
    if args.published:
        doc["published"] = sweep_published(rtts, args.steps)
    else:
        sys.path.insert(0, str(REPO))
        import rgpu

        doc["ours"] = sweep_ours(rtts, args.steps, tuple(args.modes.split(",")))
        if args.compression:
            doc["compression_10mbit"] = compression_at_10mbit(max(args.steps // 2, 5))
        # the two models are the same: their losses must agree with plain CPU torch
        ref = make_loop("item", "cpu", rgpu)
        ref(3)
        doc["cpu_reference_last_loss"] = ref(args.steps)[-1]
        doc["ours"]["loss_matches_cpu"] = all(
            abs(pt["last_loss"] - doc["cpu_reference_last_loss"]) < 1e-3
            for pts in doc["ours"]["modes"].values()
            for pt in pts
        )
    emit(doc, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
