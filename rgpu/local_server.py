"""The embedded server: an `rgpu-server` subprocess on a free loopback port, owned by this client.

Used when nothing is configured (no `RGPU_SERVER`, no `rgpu.connect(url)`) and for
`rgpu.connect("local")`. It exits when this process exits, even if this process is killed,
because it watches its standard input, which only this process holds.
"""

from __future__ import annotations

import logging
import os
import secrets
import subprocess
import sys
import tempfile
import threading

from .errors import ConnectError

log = logging.getLogger("rgpu")
START_TIMEOUT = 120.0


def default_threads() -> int:
    """Threads for the embedded server's CPU kernels: every core this process may use but one.

    Why: this process dispatches the ops on a core of its own while the server runs them. With a
    kernel thread on every core, each parallel kernel waits to wake a thread on the core this
    process holds. On 2 cores, one kernel thread took training steps against local CPU torch from
    3.54x to 2.12x (GPT-2), 3.13x to 2.01x (Llama), 2.40x to 2.03x (TinyLM), at the cost of
    large matmuls, 1.75x slower there. A reduction split over fewer threads may round
    differently from local torch in the last bit, as any other device does.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        cores = os.cpu_count() or 1
    return max(1, cores - 1)


class EmbeddedServer:
    """A running `python -m rgpu_server` child and its URL."""

    def __init__(
        self, device: str = "auto", data_dir: str | None = None, threads: int | None = None
    ) -> None:
        """`data_dir`: the server's --data-dir, named `local` (default: this process's working
        directory, so rgpu.files reads and writes files next to the notebook or script).
        `threads`: its --threads (default: one per core but one, see `default_threads`)."""
        fd, self.log_path = tempfile.mkstemp(prefix="rgpu-server-", suffix=".log")
        self._log = os.fdopen(fd, "wb")
        # a fresh token, handed over on stdin: it never shows in a process list or the environment
        self.token = secrets.token_urlsafe(32)
        cmd = [
            sys.executable, "-m", "rgpu_server", "--host", "127.0.0.1", "--port", "0",
            "--device", device, "--announce", "--token-stdin", "--exit-with-stdin",
            "--data-dir", f"local={data_dir or os.getcwd()}",
            "--threads", str(threads or default_threads()),
            # it gets work at once: importing Inductor in the background would slow that work
            "--no-preload-inductor",
        ]  # fmt: skip
        # a session of its own: Jupyter's "interrupt kernel" signals the kernel's whole process
        # group, and the server must survive it; it still ends with the client (its stdin closes)
        self.process = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            close_fds=True,
            start_new_session=True,
        )
        assert self.process.stdin is not None
        self.process.stdin.write(self.token.encode() + b"\n")
        self.process.stdin.flush()
        self.url = self._read_url()

    def _read_url(self) -> str:
        line: list[bytes] = []

        def read() -> None:
            assert self.process.stdout is not None
            line.append(self.process.stdout.readline())

        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(START_TIMEOUT)
        text = line[0].decode().strip() if line else ""
        if not text.startswith("RGPU_SERVER="):
            self.stop()
            try:
                with open(self.log_path, encoding="utf-8", errors="replace") as f:
                    tail = f.read()[-2000:]
            except OSError:
                tail = ""
            raise ConnectError(
                f"the embedded rgpu server did not start. Its log ({self.log_path}):\n{tail}"
            )
        return text.split("=", 1)[1]

    def stop(self) -> None:
        p = self.process
        if p.poll() is None:
            try:
                if p.stdin:
                    p.stdin.close()  # the server exits when its stdin closes
                p.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                p.kill()
                p.wait(timeout=5)
        for f in (p.stdout, self._log):
            try:
                if f:
                    f.close()
            except OSError:
                pass
        if p.returncode == 0:  # keep the log of a server that failed, for the error message
            try:
                os.unlink(self.log_path)
            except OSError:
                pass
