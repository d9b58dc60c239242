"""Reach an rgpu server over SSH: a tunnel through the system `ssh`, and a server started on demand.

`rgpu.connect("ssh://user@gpuhost")` forwards a free port on this machine's loopback address to
the rgpu server port on the host (`ssh -N -L`), starting `rgpu-server` there first when none
listens. The system `ssh` client does the work, so keys, the agent, `~/.ssh/config`, ProxyJump and
known_hosts behave exactly as they do in a terminal; it runs with `BatchMode=yes` (no prompts).

A server started here gets a fresh token on the SSH session's standard input (never in a process
list, the environment or a log) and exits when that SSH session ends (`--exit-with-stdin`): when
the client disconnects, exits, or dies. The tunnel is a separate `ssh` process, so a tunnel that
dies is simply opened again (`SshTunnel.ensure`, called by the session before every reconnect) and
the session resumes as after any dropped link.
"""

from __future__ import annotations

import atexit
import logging
import os
import shlex
import socket
import subprocess
import threading
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from .config import DEFAULT, Config
from .errors import AuthError, ConnectError, SessionLost
from .session import Session
from .ssh_process import (
    Output,
    RemoteServer,
    free_port,
    popen,
    server_script,
    ssh_base,
    ssh_error,
    terminate,
)
from .ssh_target import (
    DEFAULT_PORT,
    ServerMissing,
    SshAuthError,
    SshError,
    SshTarget,
    SshUnreachable,
    parse_ssh_url,
)

log = logging.getLogger("rgpu")

ALIVE = ("-o", "ServerAliveInterval=10", "-o", "ServerAliveCountMax=3")  # a dead link ends ssh

__all__ = [
    "DEFAULT_PORT",
    "RemoteServer",
    "ServerMissing",
    "SshAuthError",
    "SshError",
    "SshTarget",
    "SshTunnel",
    "SshUnreachable",
    "open_session",
    "parse_ssh_url",
    "server_script",
]


class SshTunnel:
    """A local port forwarded to the rgpu server on an SSH host, kept open while a session lives.

    `start()` opens it (starting a server on the host when asked or needed) and returns the
    ``ws://127.0.0.1:PORT`` URL; `token` is then the token to send. `ensure()` re-opens a tunnel
    whose ssh died (on the same local port when it is still free) and is what `rgpu.Session`
    calls before every reconnect; `stop()` closes the tunnel and stops a server started here.
    """

    def __init__(
        self,
        target: str | SshTarget,
        *,
        token: str | None = None,
        timeout: float = 10.0,
        **options: Any,
    ) -> None:
        if isinstance(target, str):
            target = parse_ssh_url(target, options)
        elif options:
            target = replace(target, **options)
        self.target = target
        self.token = token or target.token
        self.timeout = timeout
        self.ssh = ssh_base(target, timeout)
        self.remote_port = target.port
        self.local_port: int | None = None
        self.process: subprocess.Popen | None = None
        self.server: RemoteServer | None = None
        self.existing = False  # True when the server was already running on the host
        self._stderr: Output | None = None
        self._opening: subprocess.Popen | None = None  # an ssh being started; stop() ends it
        self._lock = threading.RLock()
        self._stopped = False

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.local_port}"

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> str:
        """Open the tunnel (and start a server on the host if needed); the URL to connect to."""
        with self._lock:
            _LIVE.add(self)
            try:
                self._start()
            except BaseException:
                self.stop()
                raise
            return self.url

    def _start(self) -> None:
        t, dest = self.target, self.target.destination
        if t.start != "yes":
            self._open()
            found = self._probe()
            if found == "rgpu":
                self.existing = True
                if self.token is None:
                    self.token = self._read_token_file()
                return
            if t.start == "no":
                what = "nothing" if found == "none" else "a program that is not an rgpu server"
                raise ConnectError(
                    f"{what} listens on port {t.port} of {dest}, and start=no. Start `rgpu-server "
                    f"--port {t.port}` there, or drop start=no to let rgpu start one."
                )
            self._close_process()
        self.server = RemoteServer(t, self.ssh, self.timeout)
        self.token = self.server.token
        self.remote_port = self.server.port
        self._open()

    def _probe(self) -> str:
        """What listens on the remote port: "rgpu", "other" or "none" (ssh drops the forwarded
        connection at once when the host refuses it). A request with an Origin header gets a
        silent 403 from rgpu-server, so probing leaves no line in its log."""
        try:
            with socket.create_connection(("127.0.0.1", self.local_port), self.timeout) as s:
                s.settimeout(self.timeout)
                s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: rgpu-probe\r\n\r\n")
                data = b""
                while b"\r\n\r\n" not in data and len(data) < 4096:
                    chunk = s.recv(4096)
                    if not chunk:
                        break
                    data += chunk
        except TimeoutError:
            return "other"
        except OSError:
            return "none"
        if not data:
            return "none"
        return "rgpu" if b"rgpu-server" in data else "other"

    def _read_token_file(self) -> str | None:
        """The token of a server that runs with `--token-file`, read over SSH (`cat`); its bytes
        travel only through the SSH connection's stdout."""
        path = self.target.token_file or f".config/rgpu/token-{self.target.port}"
        argv = [*self.ssh, "-T", "-o", "ClearAllForwardings=yes", "--", self.target.destination,
                "cat " + shlex.quote(path)]  # fmt: skip
        try:
            done = subprocess.run(
                argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=self.timeout + 10
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        token = done.stdout.decode(errors="replace").strip()
        return token if done.returncode == 0 and token else None

    def _open(self) -> None:
        """Start `ssh -N -L` to the remote port and wait until the local end accepts."""
        dest = self.target.destination
        preferred = self.local_port
        for attempt in range(3):
            port = preferred if (preferred and attempt == 0) else free_port()
            argv = [*self.ssh, "-N", "-o", "ExitOnForwardFailure=yes", *ALIVE,
                    "-L", f"127.0.0.1:{port}:127.0.0.1:{self.remote_port}", "--", dest]  # fmt: skip
            p = popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,  # a Ctrl-C in the terminal must not cut the tunnel
            )
            self._opening = p
            stderr = Output(p.stderr)
            deadline = time.monotonic() + self.timeout + 10
            while p.poll() is None and time.monotonic() < deadline and not self._stopped:
                try:
                    socket.create_connection(("127.0.0.1", port), 1).close()
                except OSError:
                    time.sleep(0.03)
                    continue
                if p.poll() is None:
                    self.process, self.local_port, self._stderr = p, port, stderr
                    self._opening = None
                    return
            self._opening = None
            if self._stopped:
                terminate(p)
                raise ConnectError(f"the SSH tunnel to {dest} was closed")
            if p.poll() is None:
                terminate(p)
                raise SshError(
                    f"ssh to {dest} did not open the tunnel within {self.timeout + 10:.0f} s "
                    f"(ran: {shlex.join(argv)})\n{stderr.text()}"
                )
            said = stderr.text(wait=2)
            terminate(p)
            if "address already in use" in said.lower() and f":{port}" in said and attempt < 2:
                continue  # someone took the port we picked: pick another
            raise ssh_error(
                dest, p.returncode, said, f"127.0.0.1:{port} -> port {self.remote_port}"
            )

    def ensure(self) -> str:
        """The URL to use now, re-opening the tunnel first if its ssh died.

        Raises `SessionLost` when a server started here has exited (its session is gone for
        good), and `ConnectError` when the tunnel cannot be opened now (the caller retries).
        """
        with self._lock:
            if self._stopped:
                raise ConnectError(f"the SSH tunnel to {self.target.destination} was closed")
            if self.server is not None and not self.server.alive:
                raise SessionLost(
                    f"the rgpu server that rgpu started on {self.target.destination} over SSH has "
                    "exited (its SSH session ended): this session and every rgpu tensor in it are "
                    "gone. Call rgpu.connect() to start a new one. Its last words:\n"
                    + "\n".join(self.server.log().splitlines()[-5:])
                )
            if not self.alive:
                if self.process is not None:
                    assert self._stderr is not None
                    said = " ".join(self._stderr.text().splitlines()[-2:])
                    log.warning(
                        "rgpu: the SSH tunnel to %s ended (status %s%s); opening it again",
                        self.target.destination,
                        self.process.returncode,
                        f": {said}" if said else "",
                    )
                self._close_process()
                self._open()
            return self.url

    def _close_process(self) -> None:
        if self.process is not None:
            terminate(self.process)
            self.process = None

    def stop(self) -> None:
        """Close the tunnel and stop a server started on the host. Idempotent."""
        self._stopped = True
        opening = self._opening
        if opening is not None:  # a reconnect is opening a tunnel: do not wait for it
            opening.kill()
        with self._lock:
            self._stopped = True
            self._close_process()
            if self.server is not None:
                self.server.stop()
            _LIVE.discard(self)

    def describe(self) -> str:
        """One line for the user: where the tunnel goes and whether a server was started."""
        where = f"{self.target.destination} port {self.remote_port}"
        how = "an rgpu-server started there" if self.server else "the rgpu server running there"
        return f"127.0.0.1:{self.local_port} -> {where} over SSH ({how})"


_LIVE: set[SshTunnel] = set()


_PID = os.getpid()


@atexit.register
def _stop_all() -> None:
    """At exit, no tunnel or server outlives this process (after `rgpu.disconnect`, which runs
    first: `rgpu.current` registers it later)."""
    if os.getpid() != _PID:  # a forked child: the tunnels and jobs are its parent's
        return
    for tunnel in list(_LIVE):
        tunnel.stop()


def open_session(
    url: str,
    *,
    token: str | None = None,
    timeout: float = 10.0,
    options: Mapping[str, Any] | None = None,
    config: Config = DEFAULT,
    name: str | None = None,
    takeover: bool = False,
) -> Session:
    """A `Session` through a new SSH tunnel; the tunnel is its transport and closes with it."""
    options = {"ssh_command": config.ssh_command, **dict(options or {})}
    tunnel = SshTunnel(url, token=token, timeout=timeout, **options)
    tunnel.start()
    try:
        return Session(
            tunnel.url, token=tunnel.token, open_timeout=timeout, config=config, transport=tunnel,
            name=name, takeover=takeover,
        )  # fmt: skip
    except AuthError as e:
        tunnel.stop()
        if tunnel.existing:
            port, dest = tunnel.remote_port, tunnel.target.destination
            raise AuthError(
                f"the rgpu server already running on port {port} of {dest} wants its token: {e} "
                f"Over SSH, rgpu reads it from .config/rgpu/token-{port} on the host when the "
                "server runs with `rgpu-server --token-file`; or add start=yes to the URL to "
                "start a private server instead."
            ) from None
        raise
    except BaseException:
        tunnel.stop()
        raise
