"""A real `rgpu-server` subprocess for tests (a module of its own so any test can import it)."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import threading
import time

# one token for the test servers; clients (in-process and subprocesses) read it from RGPU_TOKEN
TOKEN_FOR_TESTS = secrets.token_urlsafe(24)
os.environ["RGPU_TOKEN"] = TOKEN_FOR_TESTS


class ServerProcess:
    """`python -m rgpu_server` on 127.0.0.1:0; `url` once it listens."""

    def __init__(
        self, *extra: str, env: dict | None = None, device: str = "cpu", port: int = 0
    ) -> None:
        cmd = [sys.executable, "-m", "rgpu_server", "--host", "127.0.0.1", "--port", str(port), "--device", device,
               "--announce", "--no-preload-inductor", *extra]  # fmt: skip
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

    def wait_log(self, text: str, timeout: float = 10) -> str:
        """The log, once it contains `text` (or after `timeout`)."""
        deadline = time.time() + timeout
        while text not in self.log() and time.time() < deadline:
            time.sleep(0.02)
        return self.log()

    def stop(self, timeout: float = 10) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def port_of(url: str) -> int:
    """The port of a ws://host:port URL."""
    return int(url.rsplit(":", 1)[1])
