"""Test fixtures: a real `rgpu-server --device cpu` subprocess on a free loopback port.

Every end-to-end test talks to it over a real websocket; nothing is mocked. The server runs for the
whole test session; tests that need their own server (CLI, shutdown, embedded) start one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import rgpu

ROOT = Path(__file__).resolve().parent.parent
# predicted output metadata is checked against what the server produced for every op in tests
os.environ.setdefault("RGPU_CHECK_META", "1")


class ServerProcess:
    """`python -m rgpu_server` on 127.0.0.1:0; `url` once it listens."""

    def __init__(self, *extra: str, env: dict | None = None, device: str = "cpu") -> None:
        cmd = [sys.executable, "-m", "rgpu_server", "--host", "127.0.0.1", "--port", "0", "--device", device,
               "--announce", *extra]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, **(env or {})},
            text=True,
        )
        self.log_lines: list[str] = []
        line = self.proc.stdout.readline().strip()
        self._drain = threading.Thread(target=self._read_stderr, daemon=True)
        self._drain.start()
        if not line.startswith("RGPU_SERVER="):
            self.stop()
            raise RuntimeError(f"rgpu-server did not start: {line!r}\n" + "\n".join(self.log_lines))
        self.url = line.split("=", 1)[1]

    def _read_stderr(self) -> None:
        for line in self.proc.stderr:
            self.log_lines.append(line.rstrip("\n"))

    def log(self) -> str:
        return "\n".join(self.log_lines)

    def stop(self, timeout: float = 10) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="session")
def server():
    srv = ServerProcess()
    yield srv
    rgpu.disconnect()
    srv.stop()


@pytest.fixture
def session(server):
    """The current rgpu session, connected to the shared test server."""
    import rgpu.current

    s = rgpu.current.get()
    if s is None or s.closed or s.url != server.url or s._broken is not None:
        s = rgpu.connect(server.url)
    return s


@pytest.fixture
def dev(session):
    """The device string, with the session guaranteed connected and error-free."""
    yield "rgpu"
    # a test that leaves a pending remote error must not leak it into the next test
    try:
        torch.rgpu.synchronize()
    except rgpu.RemoteError:
        pass


class StatsDelta:
    def __init__(self) -> None:
        self.start = rgpu.stats()

    def __call__(self) -> dict:
        now = rgpu.stats()
        return {k: now[k] - self.start[k] for k in now}


@pytest.fixture
def counted(dev):
    """Call it to get the stats accumulated since the test started."""
    torch.rgpu.synchronize()
    return StatsDelta()
