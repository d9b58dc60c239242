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
import collections
import logging
import math
import os
import queue
import secrets
import shlex
import socket
import subprocess
import threading
import time
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from .errors import AuthError, ConnectError, SessionLost

log = logging.getLogger("rgpu")

DEFAULT_PORT = 9720
START_TIMEOUT = 120.0  # a first `import torch` on a cold GPU host can take a minute
STARTS = ("auto", "yes", "no")
ALIVE = ("-o", "ServerAliveInterval=10", "-o", "ServerAliveCountMax=3")  # a dead link ends ssh
INSTALL_HINT = (
    "Install it there with `pip install jupyter-rgpu` in a Python environment that has torch "
    "{torch} (the same major.minor as this machine), or point rgpu at it: "
    "ssh://{dest}?server_command=/path/to/rgpu-server (or 'python3 -m rgpu_server')."
)


class SshError(ConnectError):
    """`ssh` to the GPU host failed (the message carries what ssh said and what to do)."""


class SshUnreachable(SshError):
    """The GPU host could not be reached: unknown name, refused or timed-out connection."""


class SshAuthError(SshError):
    """The host refused the SSH login (no usable key: rgpu's ssh never prompts)."""


class ServerMissing(SshError):
    """No `rgpu-server` could be started on the host (it is not installed, or not on PATH)."""


@dataclass
class SshTarget:
    """Where and how to reach the server: parsed from an ``ssh://`` URL plus keyword options."""

    destination: str  # "user@host" or a Host alias of ~/.ssh/config
    ssh_port: int | None = None
    port: int = DEFAULT_PORT  # the rgpu server's port on the host's loopback address
    identity: str | None = None
    start: str = "auto"  # auto: use a server on `port`, else start one; yes: always; no: never
    device: str | None = None  # --device of a server started here
    server_command: str | None = None  # remote command line that runs rgpu-server
    # on the host, for a server already running there: default .config/rgpu/token-PORT
    token_file: str | None = None
    # the local ssh client and its options: default $RGPU_SSH_COMMAND, else "ssh"
    ssh_command: str | None = None
    token: str | None = field(default=None, repr=False)

    @property
    def host(self) -> str:
        return self.destination.rpartition("@")[2]


_OPTIONS = {f.name for f in fields(SshTarget)} - {"destination"}


def parse_ssh_url(url: str, options: Mapping[str, Any] | None = None) -> SshTarget:
    """``ssh://[user@]host[:sshport][?port=9720&identity=PATH&start=auto|yes|no&...]`` and keyword
    options (which win over the URL's query) as an `SshTarget`; refuses what ssh would misread."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme.lower() != "ssh":
        raise ConnectError(f"not an ssh:// URL: {url}")
    netloc = parts.netloc
    user, at, hostport = netloc.rpartition("@")
    if hostport.startswith("["):  # [ipv6]:port
        host, _, rest = hostport[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    else:
        host, _, port_text = hostport.partition(":")
    user, host = urllib.parse.unquote(user), urllib.parse.unquote(host)
    if (
        not host
        or host.startswith("-")
        or user.startswith("-")
        or any(c in netloc for c in " \t\n'\"\\")
    ):
        raise ConnectError(f"{url!r} does not name an SSH host (expected ssh://user@host[:port])")
    values: dict[str, Any] = {}
    if port_text:
        values["ssh_port"] = port_text
    for key, value in urllib.parse.parse_qsl(parts.query, keep_blank_values=True):
        values[key] = value
    values.update({k: v for k, v in (options or {}).items() if v is not None})
    unknown = sorted(set(values) - _OPTIONS)
    if unknown:
        raise ConnectError(
            f"unknown ssh option(s) {', '.join(unknown)} for {url}; known: {', '.join(sorted(_OPTIONS))}"
        )
    target = SshTarget(destination=f"{user}@{host}" if at else host)
    for key in ("ssh_port", "port"):
        if key in values:
            try:
                values[key] = int(values[key])
            except (TypeError, ValueError):
                raise ConnectError(f"{key} must be a number, not {values[key]!r} ({url})") from None
            if not 0 < values[key] < 65536:
                raise ConnectError(f"{key} {values[key]} is not a TCP port ({url})")
    start = str(values.get("start", "auto")).lower()
    if start not in STARTS:
        raise ConnectError(f"start must be one of {', '.join(STARTS)}, not {start!r} ({url})")
    values["start"] = start
    if values.get("identity"):
        values["identity"] = os.path.expanduser(str(values["identity"]))
    return replace(target, **values)


def _popen(argv: list[str], **kwargs: Any) -> subprocess.Popen:
    try:
        return subprocess.Popen(argv, **kwargs)
    except FileNotFoundError:
        raise SshError(
            f"no ssh client `{argv[0]}` on this machine: install OpenSSH's client, or name one in "
            "RGPU_SSH_COMMAND"
        ) from None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Output:
    """Drains a child's pipe on a daemon thread: lines to a bounded tail, and optionally a queue."""

    def __init__(self, pipe: Any, lines: queue.Queue | None = None, keep: int = 200) -> None:
        self.tail: collections.deque[str] = collections.deque(maxlen=keep)
        self._lines = lines
        self._thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self._thread.start()

    def _read(self, pipe: Any) -> None:
        try:
            for raw in pipe:
                line = raw.decode(errors="replace").rstrip("\r\n")
                self.tail.append(line)
                if self._lines is not None:
                    self._lines.put(line)
        except (OSError, ValueError):
            pass
        if self._lines is not None:
            self._lines.put(None)

    def text(self, wait: float = 0.0) -> str:
        self._thread.join(wait)
        return "\n".join(self.tail)


def _ssh_error(dest: str, rc: int | None, stderr: str, what: str) -> SshError:
    """Turn what ssh printed into an error that says what went wrong and what to do."""
    lines = [ln for ln in stderr.splitlines() if ln.strip() and "open failed" not in ln]
    said = ("\n".join(lines[-8:]) or f"ssh exited with status {rc}").strip().rstrip(".")
    low = said.lower()
    if "permission denied" in low or "too many authentication failures" in low:
        return SshAuthError(
            f"{dest} refused the SSH login ({said.strip()}). rgpu runs ssh without prompts "
            "(BatchMode=yes): use a key that the host accepts, loaded in ssh-agent or given as "
            "?identity=PATH (rgpu-run: -i PATH), or configured for this host in ~/.ssh/config."
        )
    if "host key verification failed" in low or "remote host identification has changed" in low:
        return SshError(
            f"ssh could not verify the host key of {dest} ({said.strip()}). Run `ssh {dest}` once "
            "in a terminal to check and accept it, then connect again."
        )
    unreachable = (
        "could not resolve hostname", "connection refused", "timed out", "no route to host",
        "network is unreachable", "connection closed by", "connection reset",
        "name or service not known",
    )  # fmt: skip
    if any(s in low for s in unreachable):
        return SshUnreachable(f"cannot reach {dest} over SSH: {said.strip()}")
    if "address already in use" in low or "forwarding" in low:
        return SshError(
            f"ssh could not set up the port forward for {what} ({said.strip()}). If ~/.ssh/config "
            f"sets LocalForward for {dest}, another ssh may already hold that port."
        )
    return SshError(f"ssh to {dest} failed ({what}): {said.strip()}")


def server_script(target: SshTarget) -> str:
    """The POSIX sh script that starts rgpu-server on the host: the given command, else
    `rgpu-server` on PATH, else a python that has the module; else it prints RGPU_NO_SERVER and
    exits 127. The token is not in it: it follows on stdin (`--token-stdin`)."""
    args = "--host 127.0.0.1 --port 0 --announce --token-stdin --exit-with-stdin"
    if target.device:
        args += " --device " + shlex.quote(target.device)
    if target.server_command:
        return f"exec {target.server_command} {args}"
    return (
        f"if command -v rgpu-server >/dev/null 2>&1; then exec rgpu-server {args}; fi; "
        "for py in python3 python; do "
        'if "$py" -c "import importlib.util as u, sys; '
        "sys.exit(u.find_spec('rgpu_server') is None)\" >/dev/null 2>&1; "
        f'then exec "$py" -m rgpu_server {args}; fi; done; '
        "echo RGPU_NO_SERVER; exit 127"
    )


class RemoteServer:
    """`rgpu-server` started on the host over SSH, with a fresh token sent on its standard input.

    It listens on the host's 127.0.0.1 on a free port and exits when this SSH session ends.
    """

    def __init__(self, target: SshTarget, ssh: list[str], timeout: float) -> None:
        self.target = target
        self.token = secrets.token_urlsafe(32)
        # ClearAllForwardings: LocalForward lines of ~/.ssh/config must not be set up (or clash) here
        argv = [*ssh, "-T", "-o", "ClearAllForwardings=yes", "--", target.destination,
                "sh -c " + shlex.quote(server_script(target))]  # fmt: skip
        self.process = _popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # a Ctrl-C in the terminal must not end the server
        )
        self._stdout_lines: queue.Queue = queue.Queue()
        assert self.process.stdout is not None and self.process.stderr is not None
        self._stdout = _Output(self.process.stdout, self._stdout_lines)
        self._stderr = _Output(self.process.stderr)
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(self.token.encode() + b"\n")
            self.process.stdin.flush()
        except OSError:
            pass  # ssh already exited: reported below
        try:
            self.port = self._wait_for_port(timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_for_port(self, timeout: float) -> int:
        deadline = time.monotonic() + START_TIMEOUT + timeout
        dest = self.target.destination
        while True:
            try:
                line = self._stdout_lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise ConnectError(
                    f"rgpu-server on {dest} did not start within {START_TIMEOUT + timeout:.0f} s. "
                    f"What it printed:\n{self.log()}"
                ) from None
            if line is None:  # stdout closed: the remote command (or ssh) exited
                break
            if line.startswith("RGPU_SERVER="):
                return int(line.rsplit(":", 1)[1].strip("/"))
            if line.strip() == "RGPU_NO_SERVER":
                break
        try:
            rc = self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            rc = None
        said = self._stderr.text(wait=2)
        import torch

        hint = INSTALL_HINT.format(torch=".".join(torch.__version__.split(".")[:2]), dest=dest)
        if rc == 255:
            return_error = _ssh_error(dest, rc, said, "starting rgpu-server")
            raise return_error
        if rc == 127 and not self.target.server_command:
            raise ServerMissing(
                f"no rgpu-server on {dest}: neither `rgpu-server` nor a python with the rgpu_server "
                f"module is on the PATH of a non-interactive SSH session there. {hint}"
            )
        if rc == 127:
            raise ServerMissing(
                f"`{self.target.server_command}` was not found on {dest} ({said.strip()}). {hint}"
            )
        raise ConnectError(
            f"rgpu-server on {dest} exited with status {rc} before it listened. What it printed:\n"
            f"{said[-3000:] or '(nothing)'}"
        )

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def log(self) -> str:
        """What the server (and ssh) printed on stderr lately: its start-up and session lines."""
        return self._stderr.text()

    def stop(self) -> None:
        """Close the SSH session's stdin: the server shuts down cleanly and ssh exits after it."""
        _terminate(self.process, close_stdin=True)


def _terminate(p: subprocess.Popen, close_stdin: bool = False) -> None:
    """Stop a child politely, then firmly: closed stdin (or SIGTERM), SIGTERM, SIGKILL."""
    if p.poll() is None:
        try:
            if close_stdin and p.stdin:
                p.stdin.close()
                p.wait(timeout=5)
            else:
                p.terminate()
                p.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            try:
                p.terminate()
                p.wait(timeout=3)
            except (OSError, subprocess.TimeoutExpired):
                p.kill()
                p.wait(timeout=5)
    for f in (p.stdin, p.stdout, p.stderr):
        try:
            if f:
                f.close()
        except OSError:
            pass


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
        command = target.ssh_command or os.environ.get("RGPU_SSH_COMMAND") or "ssh"
        self.ssh = [*shlex.split(command), "-o", "BatchMode=yes"]
        self.ssh += ["-o", f"ConnectTimeout={max(1, math.ceil(timeout))}"]
        if target.ssh_port:
            self.ssh += ["-p", str(target.ssh_port)]
        if target.identity:
            self.ssh += ["-i", target.identity]
        self.remote_port = target.port
        self.local_port: int | None = None
        self.process: subprocess.Popen | None = None
        self.server: RemoteServer | None = None
        self.existing = False  # True when the server was already running on the host
        self._stderr: _Output | None = None
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
            port = preferred if (preferred and attempt == 0) else _free_port()
            argv = [*self.ssh, "-N", "-o", "ExitOnForwardFailure=yes", *ALIVE,
                    "-L", f"127.0.0.1:{port}:127.0.0.1:{self.remote_port}", "--", dest]  # fmt: skip
            p = _popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,  # a Ctrl-C in the terminal must not cut the tunnel
            )
            self._opening = p
            stderr = _Output(p.stderr)
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
                _terminate(p)
                raise ConnectError(f"the SSH tunnel to {dest} was closed")
            if p.poll() is None:
                _terminate(p)
                raise SshError(
                    f"ssh to {dest} did not open the tunnel within {self.timeout + 10:.0f} s "
                    f"(ran: {shlex.join(argv)})\n{stderr.text()}"
                )
            said = stderr.text(wait=2)
            _terminate(p)
            if "address already in use" in said.lower() and f":{port}" in said and attempt < 2:
                continue  # someone took the port we picked: pick another
            raise _ssh_error(
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
            _terminate(self.process)
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


@atexit.register
def _stop_all() -> None:
    """At exit, no tunnel or server outlives this process (after `rgpu.disconnect`, which runs
    first: `rgpu.current` registers it later)."""
    for tunnel in list(_LIVE):
        tunnel.stop()


def open_session(
    url: str,
    *,
    token: str | None = None,
    timeout: float = 10.0,
    options: Mapping[str, Any] | None = None,
) -> Any:
    """A `Session` through a new SSH tunnel; the tunnel is its transport and closes with it."""
    from .session import Session

    tunnel = SshTunnel(url, token=token, timeout=timeout, **dict(options or {}))
    tunnel.start()
    try:
        return Session(tunnel.url, token=tunnel.token, open_timeout=timeout, transport=tunnel)
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
