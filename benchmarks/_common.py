"""The three device-core workloads, shared by bench_core.py (this repo's rgpu) and
bench_published.py (rgpu 0.1.1 from PyPI, run in its own virtualenv).

Why a shared module: the two clients must run exactly the same loops to be comparable, and the
published one lives in another environment, so this module never imports `rgpu` itself; it gets
the remote device's `stats` and `synchronize` from its caller.

Every rgpu number is measured next to a local twin in the same run (plain CPU torch doing the
same work, or a raw loopback TCP socket moving the same bytes), interleaved repeat by repeat,
because this shared 2-core machine drifts from minute to minute and a ratio survives that.
"""

from __future__ import annotations

import copy
import ctypes
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

MB = 1e6
TARGETS: dict[str, float] = {
    "per_op_us": 15.0,
    "per_op_waits": 1,
    "upload_MBps": 800.0,
    "download_MBps": 800.0,
    "mlp_ms_per_step": 1.5,
}
# rgpu 0.1.1 (PyPI) as measured on this machine, quoted by the milestone issue.
PUBLISHED_0_1_1: dict[str, float] = {
    "per_op_us": 126.0,
    "upload_MBps": 48.0,
    "download_MBps": 112.0,
    "mlp_ms_per_step": 7.5,
    "mlp_messages_per_step": 56.0,
}


@dataclass
class Remote:
    """How to reach the remote device under test."""

    name: str  # label for the log
    stats: Callable[[], dict[str, Any]]  # counters: messages, waits, bytes_out, bytes_in, ...
    sync: Callable[[], None]  # torch.rgpu.synchronize
    server_pid: int | None = None  # a server on this machine: its CPU time is reported too
    device: str = "rgpu"
    # turns this repo's bulk lane on or off, so transfers are also measured as websocket frames
    set_lane: Callable[[bool], None] | None = None

    def cpu_seconds(self) -> tuple[float, float | None]:
        """CPU seconds used so far by this process (all threads) and by the server process."""
        return time.process_time(), _process_cpu_seconds(self.server_pid)


def _process_cpu_seconds(pid: int | None) -> float | None:
    """CPU time of another process's live threads, in ns resolution from /proc (Linux only)."""
    if pid is None:
        return None
    total = 0
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/schedstat", encoding="ascii") as f:
                total += int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return total / 1e9


def cpu_delta(
    before: tuple[float, float | None], after: tuple[float, float | None], per: float
) -> tuple[float, float | None]:
    """(client, server) CPU time between two `Remote.cpu_seconds()` readings, divided by `per`."""
    client = (after[0] - before[0]) / per
    server = None if after[1] is None or before[1] is None else (after[1] - before[1]) / per
    return client, server


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def stats_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    return {k: after[k] - before[k] for k in before}


def summary(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "all": values}


def _maybe_summary(values: list[float | None]) -> dict[str, Any] | None:
    known = [v for v in values if v is not None]
    return summary(known) if known and len(known) == len(values) else None


def pin_plan() -> tuple[set[int], set[int]] | None:
    """(client CPUs, server CPUs): the server gets the last CPU, the client the others.

    Why: on a 2-core machine the scheduler sometimes puts the client's main thread and the
    server's worker on one core, and then a message costs client + server CPU time back to back
    (bimodal results). A server on its own core is what a remote GPU host looks like.
    """
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cpus) < 2:
        return None
    return set(cpus[:-1]), {cpus[-1]}


def pin_client(cpus: set[int]) -> None:
    """Pin this process; call it before any thread (rgpu's reader) starts, so they inherit it."""
    os.sched_setaffinity(0, cpus)


def pinned_preexec(cpus: set[int]) -> Callable[[], None]:
    """A Popen preexec_fn that pins the child (and every thread it starts) to `cpus`."""
    return lambda: os.sched_setaffinity(0, cpus)


def machine(client: str) -> dict[str, Any]:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=False,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        ).stdout.strip()
    except OSError:
        commit = ""
    return {
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "client": client,
        "repo_commit": commit,  # of the checkout these scripts are in
        "loadavg_at_start": os.getloadavg(),  # other work on the machine skews the numbers
    }


def doc_header(benchmark: str, client: str) -> dict[str, Any]:
    """What every result document starts with: which benchmark, when, how, on what."""
    return {
        "benchmark": benchmark,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([_python_name(), *sys.argv]),
        "machine": machine(client),
    }


def header(client: str, server: dict[str, Any]) -> dict[str, Any]:
    return {
        **doc_header("device-core", client),
        "server": server,
        "targets": TARGETS,
        "published_rgpu_0_1_1": PUBLISHED_0_1_1,
    }


def _python_name() -> str:
    """`python`, or the full path when running in a virtualenv (the published rgpu's)."""
    return sys.executable if sys.prefix != sys.base_prefix else "python"


def emit(doc: dict[str, Any], out: str | None) -> None:
    text = json.dumps(doc, indent=2)
    print(text)
    if out:
        with open(out, "w", encoding="utf-8") as f:
            f.write(text + "\n")


# -- a. eager per-op cost --------------------------------------------------------------------


def op_loop(remote: Remote | None, n: int) -> tuple[float, float, dict[str, Any]]:
    """`x = x + 1` n times on 16 floats, then one `.item()`: (seconds, value, counters).

    `remote` None runs the loop on local CPU torch. The counters include the CPU microseconds
    per op that the client process and the server process spent.
    """
    x = torch.zeros(16, device=remote.device if remote else "cpu")
    if remote:
        remote.sync()
        before = remote.stats()
        cpu0 = remote.cpu_seconds()
    t0 = time.perf_counter()
    for _ in range(n):
        x = x + 1
    value = x.sum().item()
    dt = time.perf_counter() - t0
    if not remote:
        return dt, value, {}
    delta = stats_delta(before, remote.stats())
    delta["cpu_us_per_op_client_server"] = cpu_delta(
        cpu0, remote.cpu_seconds(), n / 1e6
    )  # (client, server)
    return dt, value, delta


def bench_per_op(remote: Remote, n: int = 5000, repeats: int = 5) -> dict[str, Any]:
    x = torch.zeros(16, device=remote.device)
    for _ in range(300):  # warm the meta-inference cache and the connection
        x = x + 1
    remote.sync()
    remote_us: list[float] = []
    local_us: list[float] = []
    counts: list[dict[str, Any]] = []
    for r in range(repeats):
        dt, value, delta = op_loop(remote, n)
        if value != 16.0 * n:
            raise SystemExit(f"per-op loop computed {value}, expected {16.0 * n}")
        remote_us.append(dt / n * 1e6)
        counts.append(delta)
        dt_local, _, _ = op_loop(None, n)
        local_us.append(dt_local / n * 1e6)
        log(f"per-op {r}: {remote.name} {remote_us[-1]:.1f} us/op, local {local_us[-1]:.2f} us/op")
    med = statistics.median(remote_us)
    waits = [c["waits"] for c in counts]
    out: dict[str, Any] = {
        "workload": f"{n} x `x = x + 1` on torch.zeros(16) float32, then x.sum().item()",
        "ops": n,
        "rgpu_us_per_op": summary(remote_us),
        "local_us_per_op": summary(local_us),
        "ratio_rgpu_over_local": med / statistics.median(local_us),
        "messages": counts[-1]["messages"],
        "waits": counts[-1]["waits"],
        "waits_all_repeats": waits,
        "bytes_out_per_op": counts[-1]["bytes_out"] / n,
        "client_cpu_us_per_op": summary([c["cpu_us_per_op_client_server"][0] for c in counts]),
        "server_cpu_us_per_op": _maybe_summary(
            [c["cpu_us_per_op_client_server"][1] for c in counts]
        ),
        "stats_last_repeat": counts[-1],
        "target_us_per_op": TARGETS["per_op_us"],
        "meets_target": med <= TARGETS["per_op_us"] and all(w == 1 for w in waits),
    }
    return out


# -- b. bulk transfers -----------------------------------------------------------------------


def raw_bytes(t: torch.Tensor) -> memoryview:
    """A byte view of a contiguous CPU tensor (no numpy needed); keep `t` alive while used."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def socket_seconds(payload: memoryview) -> float:
    """Move `payload` over loopback TCP: a sender thread, recv_into a preallocated bytearray."""
    n = len(payload)
    sink = bytearray(n)
    view = memoryview(sink)
    with socket.create_server(("127.0.0.1", 0)) as srv:
        port = srv.getsockname()[1]

        def send() -> None:
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(payload)

        sender = threading.Thread(target=send)
        t0 = time.perf_counter()
        sender.start()
        conn, _ = srv.accept()
        with conn:
            got = 0
            while got < n:
                k = conn.recv_into(view[got:])
                if k == 0:
                    raise RuntimeError("the loopback sender closed early")
                got += k
        dt = time.perf_counter() - t0
        sender.join()
    return dt


def _round_trip(
    remote: Remote, host: torch.Tensor
) -> tuple[tuple[float, float], torch.Tensor, tuple[dict[str, Any], dict[str, Any]]]:
    """Upload `host` (then a sync) and download it again: (MB/s up, MB/s down), what came back,
    and the counters of each half."""
    nbytes = host.numel() * host.element_size()
    remote.sync()
    before = remote.stats()
    t0 = time.perf_counter()
    dev = host.to(remote.device)
    remote.sync()
    up = nbytes / (time.perf_counter() - t0) / MB
    mid = remote.stats()
    t0 = time.perf_counter()
    back = dev.cpu()
    down = nbytes / (time.perf_counter() - t0) / MB
    return (up, down), back, (stats_delta(before, mid), stats_delta(mid, remote.stats()))


def bench_transfer(remote: Remote, nbytes: int = 256 << 20, repeats: int = 3) -> dict[str, Any]:
    host = torch.rand(nbytes // 4, dtype=torch.float32)
    payload = raw_bytes(host)
    up: list[float] = []
    down: list[float] = []
    sock: list[float] = []
    up_stats: dict[str, Any] = {}
    down_stats: dict[str, Any] = {}
    ws_up: list[float] = []
    ws_down: list[float] = []
    for r in range(repeats):
        if remote.set_lane is not None:  # the same transfers as websocket frames, taking turns
            remote.set_lane(False)
            rates, _, _ = _round_trip(remote, host)
            remote.set_lane(True)
            ws_up.append(rates[0])
            ws_down.append(rates[1])
            log(f"transfer {r} without the lane: up {ws_up[-1]:.0f} MB/s, down {ws_down[-1]:.0f}")
        (up_rate, down_rate), back, (up_stats, down_stats) = _round_trip(remote, host)
        up.append(up_rate)
        down.append(down_rate)
        if r == 0 and not torch.equal(back, host):
            raise SystemExit("the downloaded tensor differs from the uploaded one")
        del back
        sock.append(nbytes / socket_seconds(payload) / MB)
        log(
            f"transfer {r}: up {up[-1]:.0f} MB/s, down {down[-1]:.0f} MB/s, "
            f"loopback socket {sock[-1]:.0f} MB/s"
        )
    up_med, down_med, sock_med = (statistics.median(v) for v in (up, down, sock))
    websocket = (
        {"upload_MBps": summary(ws_up), "download_MBps": summary(ws_down)} if ws_up else None
    )
    return {
        "websocket_only": websocket,  # RGPU_LANE=0: the bytes as CHUNK/DATA frames
        "workload": f"{nbytes >> 20} MiB float32: t.to('rgpu') + synchronize(); then .cpu()",
        "bytes": nbytes,
        "upload_MBps": summary(up),
        "download_MBps": summary(down),
        "loopback_socket_MBps": summary(sock),
        "upload_over_socket": up_med / sock_med,
        "download_over_socket": down_med / sock_med,
        "upload_stats": up_stats,
        "download_stats": down_stats,
        "target_MBps": TARGETS["upload_MBps"],
        "meets_target": min(up_med, down_med) >= TARGETS["upload_MBps"],
    }


# -- c. seed MLP training step ---------------------------------------------------------------


def make_step(
    model: nn.Module, x: torch.Tensor, target: torch.Tensor
) -> Callable[[], torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = (model(x) - target).square().mean()
        loss.backward()
        opt.step()
        return loss

    return step


def run_steps(step: Callable[[], torch.Tensor], steps: int) -> tuple[float, float]:
    """`steps` training steps reading the loss every 10: (seconds, last loss read)."""
    last = float("nan")
    t0 = time.perf_counter()
    for i in range(steps):
        loss = step()
        if (i + 1) % 10 == 0:
            last = loss.item()
    return time.perf_counter() - t0, last


def bench_mlp(
    remote: Remote, steps: int = 200, warmup: int = 20, repeats: int = 3
) -> dict[str, Any]:
    torch.manual_seed(0)
    cpu_model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    remote_model = copy.deepcopy(cpu_model).to(remote.device)
    x, target = torch.randn(64, 16), torch.randn(64, 1)
    remote_step = make_step(remote_model, x.to(remote.device), target.to(remote.device))
    local_step = make_step(cpu_model, x, target)
    run_steps(remote_step, warmup)
    run_steps(local_step, warmup)
    remote.sync()
    remote_ms: list[float] = []
    local_ms: list[float] = []
    delta: dict[str, Any] = {}
    losses = (0.0, 0.0)
    cpu: list[tuple[float, float | None]] = []
    for r in range(repeats):
        before = remote.stats()
        cpu0 = remote.cpu_seconds()
        dt, remote_loss = run_steps(remote_step, steps)
        cpu.append(cpu_delta(cpu0, remote.cpu_seconds(), steps / 1e3))
        delta = stats_delta(before, remote.stats())
        remote_ms.append(dt / steps * 1e3)
        dt_local, local_loss = run_steps(local_step, steps)
        local_ms.append(dt_local / steps * 1e3)
        losses = (remote_loss, local_loss)
        log(f"mlp {r}: {remote.name} {remote_ms[-1]:.2f} ms/step, local {local_ms[-1]:.3f} ms/step")
    med = statistics.median(remote_ms)
    return {
        "workload": "Linear(16,32)-ReLU-Linear(32,1), batch 64, SGD lr 0.01, MSE; "
        f"{steps} steps after {warmup} warm-up, loss.item() every 10 steps",
        "steps": steps,
        "rgpu_ms_per_step": summary(remote_ms),
        "local_ms_per_step": summary(local_ms),
        "ratio_rgpu_over_local": med / statistics.median(local_ms),
        "messages_per_step": delta["messages"] / steps,
        "waits_per_step": delta["waits"] / steps,
        "bytes_out_per_step": delta["bytes_out"] / steps,
        "client_cpu_ms_per_step": summary([c[0] for c in cpu]),
        "server_cpu_ms_per_step": _maybe_summary([c[1] for c in cpu]),
        "stats_last_repeat": delta,
        "final_loss_rgpu": losses[0],
        "final_loss_local": losses[1],
        "target_ms_per_step": TARGETS["mlp_ms_per_step"],
        "meets_target": med <= TARGETS["mlp_ms_per_step"],
    }


def run_all(remote: Remote, doc: dict[str, Any]) -> dict[str, Any]:
    doc["per_op"] = bench_per_op(remote)
    doc["transfer"] = bench_transfer(remote)
    doc["mlp"] = bench_mlp(remote)
    doc["machine"]["loadavg_at_end"] = os.getloadavg()
    return doc
