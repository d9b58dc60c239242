"""Graph-shipping benchmark (issue 6): eager rgpu vs torch.compile with rgpu.compile_backend().

Why: a compiled graph is shipped once and then costs one CALL message per call, so it should cut
messages, bytes and client CPU per step, at the price of a start-up (client tracing + server
compile). This measures both sides, for the seed MLP (loss inside the compiled function, and only
the model compiled) and the TinyLM of bench_training.py, with the server's `eager` and `inductor`
compilers:

* warm-up: the first training step (Dynamo/AOT tracing on the client, compile on the server, the
  step itself), each in a fresh client process: cold (a new server with an empty compile cache),
  a second client on that server, and warm-cache (a new server reusing the same cache directory);
* steady state: ms, messages, waits and bytes per step, the variants (and local CPU torch) taking
  turns repeat by repeat on one server.

    python benchmarks/bench_compile.py [--out FILE.json] [--repeats 5] [--no-lm]

The server is `python -m rgpu_server --device cpu` with RGPU_COMPILE_CACHE_DIR and
TORCHINDUCTOR_CACHE_DIR pointing into a fresh temporary directory (what `--compile-cache-dir DIR`
sets); its INFO log gives each graph's "ready after X s" (compile plus first run on the server).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import IO, Any

import torch
from _common import Remote, doc_header, emit, log, stats_delta, summary
from bench_core import start_server
from bench_training import BATCH, LM, make_lm_step

import rgpu
from rgpu.models import TinyLM, lm_batch, seed_mlp

WORKLOADS = ("mlp", "mlp_model", "lm")  # mlp: loss compiled too; mlp_model: only the model
VARIANTS = ("eager", "compiled_eager", "compiled_inductor")
TARGET_MLP_MESSAGES = 4
TARGET_WARM_START_S = 2.0
MLP_STEPS, MLP_READ_EVERY = 200, 10


def mse(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x) - y).square().mean()


def build(workload: str, variant: str, device: str = "rgpu") -> Callable[[bool], float]:
    """A training step for `workload` compiled as `variant`; step(read) reads the loss (else nan).

    Every build starts from the same weights (seed 0) and data, so the variants' losses agree."""
    torch.manual_seed(0)
    backend = None
    if variant != "eager":
        backend = rgpu.compile_backend(compiler=variant.removeprefix("compiled_"))
    if workload == "lm":
        model = TinyLM(**LM).to(device)
        gen = torch.Generator().manual_seed(1)
        batches = [lm_batch(LM["vocab"], BATCH, LM["context"], gen) for _ in range(16)]
        cm = torch.compile(model, backend=backend, dynamic=False) if backend else model
        return make_lm_step(cm, device, batches)
    model = seed_mlp().to(device)
    x, y = torch.randn(64, 16).to(device), torch.randn(64, 1).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn: Callable[..., torch.Tensor] = mse
    if backend and workload == "mlp":
        loss_fn = torch.compile(mse, backend=backend, dynamic=False)
    elif backend:
        model = torch.compile(model, backend=backend, dynamic=False)  # type: ignore[assignment]

    def mlp_step(read: bool) -> float:
        opt.zero_grad()
        loss = loss_fn(model, x, y)
        loss.backward()
        opt.step()
        return loss.item() if read else float("nan")

    return mlp_step


# -- warm-up: one client process per (workload, variant) --------------------------------------


def child(url: str, workload: str, variant: str) -> dict[str, Any]:
    """Run in a fresh process: time the first step, split into tracing (until the step's ops
    are queued) and waiting (loss.item(): the server compiles and runs), then one more step."""
    rgpu.connect(url)
    step = build(workload, variant)
    torch.rgpu.synchronize()  # type: ignore[attr-defined]
    info0 = rgpu.session_info()["compile"]
    s0 = rgpu.stats()
    t0 = time.perf_counter()
    step(False)
    issue = time.perf_counter() - t0
    torch.rgpu.synchronize()  # type: ignore[attr-defined]
    first = time.perf_counter() - t0
    s1 = rgpu.stats()
    t1 = time.perf_counter()
    step(True)
    second = time.perf_counter() - t1
    info1 = rgpu.session_info()["compile"]
    rgpu.disconnect()
    return {
        "first_step_s": first,
        "client_issue_s": issue,  # tracing + graph encoding + queuing (no wait happens here)
        "wait_s": first - issue,
        "second_step_s": second,
        "first_step_stats": stats_delta(s0, s1),
        "server_compile_counters": {k: info1[k] - info0[k] for k in info0},
        "dynamo_seconds": {  # the client's Dynamo/AOT phases, summed over its graphs
            k: round(sum(v), 4) for k, v in torch._dynamo.utils.compilation_time_metrics.items()
        },
    }


READY = re.compile(r"graph (\w+) \((\d+) nodes, (\w+)\) ready after ([\d.]+) s")


def wait_for_preload(server_log: str, offset: int, timeout: float = 120) -> float | None:
    """Seconds the server took to preload Inductor (its log says so after `offset`), once it has."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(server_log, encoding="utf-8") as f:
            f.seek(offset)
            found = re.findall(r"Inductor preloaded in ([\d.]+) s", f.read())
        if found:
            log(f"server preloaded Inductor in {found[-1]} s")
            return float(found[-1])
        time.sleep(0.2)
    return None


def run_child(url: str, workload: str, variant: str, server_log: str) -> dict[str, Any]:
    """`child` in a new interpreter; adds the server's "ready after" lines logged meanwhile."""
    offset = os.path.getsize(server_log)
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, __file__, "--child", url, workload, variant],
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    if out.returncode != 0:
        raise SystemExit(f"warm-up child {workload}/{variant} failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["process_s"] = time.perf_counter() - t0  # interpreter start, imports, connect too
    with open(server_log, encoding="utf-8") as f:
        f.seek(offset)
        graphs = [m.groups() for m in READY.finditer(f.read())]
    result["server_graphs"] = [
        {"key": k, "nodes": int(n), "compiler": c, "ready_after_s": float(s)}
        for k, n, c, s in graphs
    ]
    result["server_ready_s_total"] = sum(float(g[3]) for g in graphs)
    log(
        f"warm-up {workload}/{variant}: first step {result['first_step_s']:.2f} s "
        f"(server graphs {[g['ready_after_s'] for g in result['server_graphs']]})"
    )
    return result


def server(cache: str, log_file: IO[str]) -> tuple[subprocess.Popen[str], str]:
    env = {
        "RGPU_COMPILE_CACHE_DIR": cache,
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"),
    }
    # as a user starts one: Inductor is preloaded before it takes clients (bench_core.py turns
    # that off)
    return start_server(None, extra=["--preload-inductor"], env=env, log_file=log_file)


# -- steady state ------------------------------------------------------------------------------


def steady(remote: Remote, workload: str, repeats: int) -> dict[str, Any]:
    """ms/step and counters per step for each variant and for local CPU torch, taking turns."""
    names = [*VARIANTS, "local_cpu"]
    steps = {v: build(workload, v) for v in VARIANTS}
    steps["local_cpu"] = build(workload, "eager", device="cpu")
    n, read_every = (10, 1) if workload == "lm" else (MLP_STEPS, MLP_READ_EVERY)
    for fn in steps.values():  # warm-up: compile, ship, fill the meta caches
        for _ in range(3):
            fn(True)
    remote.sync()
    ms: dict[str, list[float]] = {v: [] for v in names}
    counts: dict[str, dict[str, Any]] = {}
    last: dict[str, float] = {}
    for r in range(repeats):
        for v in names[r % len(names) :] + names[: r % len(names)]:
            s0 = remote.stats()
            t0 = time.perf_counter()
            for i in range(n):
                loss = steps[v](read=(i + 1) % read_every == 0)
            ms[v].append((time.perf_counter() - t0) / n * 1e3)
            last[v] = loss
            if v != "local_cpu":
                counts[v] = {k: c / n for k, c in stats_delta(s0, remote.stats()).items()}
        log(f"{workload} {r}: " + ", ".join(f"{v} {ms[v][-1]:.2f} ms" for v in names))
    one: dict[str, int] = {}
    for v in VARIANTS:  # one step without a read: what the issue's message target counts
        s0 = remote.stats()
        steps[v](False)
        one[v] = remote.stats()["messages"] - s0["messages"]
    remote.sync()
    return {
        "steps_per_repeat": n,
        "loss_read_every": read_every,
        "ms_per_step": {v: summary(ms[v]) for v in names},
        "per_step": counts,  # messages, waits, bytes_out, bytes_in, frames, wait_seconds
        "messages_one_step_no_read": one,
        "last_loss": last,
    }


def break_even(doc: dict[str, Any], workload: str) -> dict[str, Any]:
    """Steps after which compiling has paid back its extra start-up, from this run's numbers."""
    ms = doc["steady"][workload]["ms_per_step"]
    cold = doc["warmup"]["cold"][workload]
    warm = doc["warmup"]["warm_cache"][workload]
    out: dict[str, Any] = {}
    for v in ("compiled_eager", "compiled_inductor"):
        saving_ms = ms["eager"]["median"] - ms[v]["median"]
        for phase, runs in (("cold", cold), ("warm_cache", warm)):
            extra_s = runs[v]["first_step_s"] - cold["eager"]["first_step_s"]
            out[f"{v}/{phase}"] = {
                "extra_warmup_s": extra_s,
                "saving_ms_per_step": saving_ms,
                "break_even_steps": extra_s / saving_ms * 1e3 if saving_ms > 0 else None,
            }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="rgpu graph-shipping benchmark (JSON on stdout)")
    p.add_argument("--out", help="also write the JSON document to this file")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--no-lm", action="store_true", help="skip the TinyLM (its cold compile is slow)"
    )
    p.add_argument(
        "--child", nargs=3, metavar=("URL", "WORKLOAD", "VARIANT"), help=argparse.SUPPRESS
    )
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child)))
        return 0
    workloads = [w for w in WORKLOADS if not (args.no_lm and w == "lm")]
    cache = tempfile.mkdtemp(prefix="rgpu-compile-cache-")
    logs = [os.path.join(cache, f"server{i}.log") for i in (1, 2)]
    doc: dict[str, Any] = {
        **doc_header("compile", f"rgpu {rgpu.__version__} (this repo)"),
        "targets": {
            "mlp_messages_per_step": TARGET_MLP_MESSAGES,
            "warm_start_s": TARGET_WARM_START_S,
        },
        "warmup": {},
    }
    try:
        with open(logs[0], "w", encoding="utf-8") as f1:
            proc, url = server(cache, f1)
            try:
                for phase in ("cold", "second_client"):
                    variants = VARIANTS if phase == "cold" else VARIANTS[1:]
                    doc["warmup"][phase] = {
                        w: {v: run_child(url, w, v, logs[0]) for v in variants} for w in workloads
                    }
            finally:
                proc.terminate()
                proc.wait(timeout=60)
        offset = 0
        with open(logs[1], "w", encoding="utf-8") as f2:
            proc, url = server(cache, f2)  # a new server process, the same cache directory
            try:
                doc["warm_cache_server_preload_s"] = wait_for_preload(logs[1], offset)
                doc["warmup"]["warm_cache"] = {
                    w: {v: run_child(url, w, v, logs[1]) for v in VARIANTS[1:]} for w in workloads
                }
                session = rgpu.connect(url)
                sync = torch.rgpu.synchronize  # type: ignore[attr-defined]
                remote = Remote("rgpu", rgpu.stats, sync, server_pid=proc.pid)
                doc["server"] = {"url": url, "device_name": session.device_name}
                doc["steady"] = {w: steady(remote, w, args.repeats) for w in workloads}
                doc["server_compile_counters_end"] = rgpu.session_info()["compile"]
                rgpu.disconnect()
            finally:
                proc.terminate()
                proc.wait(timeout=60)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    doc["break_even"] = {w: break_even(doc, w) for w in workloads}
    doc["machine"]["loadavg_at_end"] = os.getloadavg()
    emit(doc, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
