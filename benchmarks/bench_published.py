"""The device-core workloads against the published rgpu 0.1.1 (PyPI), for side-by-side numbers.

Why: the milestone compares this repo's rgpu with the published one on the same machine, in the
same hour. rgpu 0.1.1 needs torch >= 2.14 and installs a package named `rgpu`, which would shadow
ours, so it lives in its own virtualenv and this script runs with that virtualenv's python:

    python -m venv /tmp/anchor-venv
    /tmp/anchor-venv/bin/pip install rgpu==0.1.1 torch==2.14.1
    /tmp/anchor-venv/bin/python benchmarks/bench_published.py [--out FILE.json] [--pin]

It starts `rgpu-opserver --device cpu` on a free loopback port (RGPU_OPSERVER points the client at
it) and stops it at the end; --pin as in bench_core.py. Same JSON shape as bench_core.py.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from _common import Remote, emit, header, log, pin_client, pin_plan, pinned_preexec, run_all


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_opserver(port: int, cpus: set[int] | None) -> subprocess.Popen[bytes]:
    """Start `rgpu-opserver --device cpu` from this interpreter's environment; wait for it."""
    exe = Path(sys.executable).parent / "rgpu-opserver"
    cmd = [str(exe), "--device", "cpu", "--port", str(port)]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=pinned_preexec(cpus) if cpus else None,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"rgpu-opserver exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("rgpu-opserver did not start listening within 120 s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="device-core benchmarks against rgpu 0.1.1 (PyPI)")
    p.add_argument("--out", help="also write the JSON document to this file")
    p.add_argument("--pin", action="store_true", help="server on the last CPU, client on the rest")
    args = p.parse_args(argv)
    plan = pin_plan() if args.pin else None
    if args.pin and plan is None:
        p.error("--pin needs at least 2 CPUs")
    if plan:
        pin_client(plan[0])
    port = free_port()
    os.environ["RGPU_OPSERVER"] = f"127.0.0.1:{port}"
    proc = start_opserver(port, plan[1] if plan else None)
    try:
        import torch

        import rgpu

        repo = Path(__file__).resolve().parent.parent
        if Path(rgpu.__file__).resolve().is_relative_to(repo):
            raise SystemExit("this is the repo's rgpu; run with the published rgpu's virtualenv")
        version = importlib.metadata.version("rgpu")
        log(f"rgpu {version} from {Path(rgpu.__file__).parent}, server on port {port}")
        server = {
            "url": os.environ["RGPU_OPSERVER"],
            "started_here": True,
            "device": "cpu",
            "pinned": {"client": sorted(plan[0]), "server": sorted(plan[1])} if plan else None,
        }
        sync = torch.rgpu.synchronize  # type: ignore[attr-defined]
        remote = Remote("rgpu-0.1.1", rgpu.stats, sync, server_pid=proc.pid)
        doc = run_all(remote, header(f"rgpu {version} (PyPI)", server))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    emit(doc, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
