"""The `ssh` processes behind an SSH reach: starting them, reading what they print, turning it into
errors that say what to do, stopping them; and `RemoteServer`, rgpu-server started on the host."""

from __future__ import annotations

import collections
import math
import queue
import secrets
import shlex
import socket
import subprocess
import threading
import time
from typing import Any

from .errors import ConnectError
from .ssh_target import ServerMissing, SshAuthError, SshError, SshTarget, SshUnreachable

START_TIMEOUT = 120.0  # a first `import torch` on a cold GPU host can take a minute
INSTALL_HINT = (
    "Install it there with `pip install jupyter-rgpu` in a Python environment that has torch "
    "{torch} (the same major.minor as this machine), or point rgpu at it: "
    "ssh://{dest}?server_command=/path/to/rgpu-server (or 'python3 -m rgpu_server')."
)


def popen(argv: list[str], **kwargs: Any) -> subprocess.Popen:
    try:
        return subprocess.Popen(argv, **kwargs)
    except FileNotFoundError:
        raise SshError(
            f"no ssh client `{argv[0]}` on this machine: install OpenSSH's client, or name one in "
            "RGPU_SSH_COMMAND"
        ) from None


def ssh_base(target: SshTarget, timeout: float) -> list[str]:
    """The ssh command line up to the destination: the user's client and options, no prompts, a
    connect timeout, the port and key of the target, and the hop to reach it through."""
    argv = [*shlex.split(target.ssh_command or "ssh"), "-o", "BatchMode=yes"]
    argv += ["-o", f"ConnectTimeout={max(1, math.ceil(timeout))}"]
    if target.ssh_port:
        argv += ["-p", str(target.ssh_port)]
    if target.identity:
        argv += ["-i", target.identity]
    if target.jump is not None:
        argv += ["-o", "ProxyCommand=" + proxy_command(target.jump, timeout)]
    return argv


def proxy_command(hop: SshTarget, timeout: float) -> str:
    """`ssh -W` through `hop`, as a ProxyCommand: the hop's own port, key and options apply (ssh's
    own ProxyJump would pass on neither -i nor BatchMode). ssh expands %h and %p to the final
    host and port; a literal % in our arguments is doubled."""
    hop_argv = [*ssh_base(hop, timeout), "-T", "-o", "ClearAllForwardings=yes"]
    quoted = " ".join(shlex.quote(a).replace("%", "%%") for a in hop_argv)
    return f"{quoted} -W '[%h]:%p' -- {shlex.quote(hop.destination).replace('%', '%%')}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Output:
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


def ssh_error(dest: str, rc: int | None, stderr: str, what: str) -> SshError:
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


SSH_SERVER_ARGS = "--host 127.0.0.1 --port 0 --announce --token-stdin --exit-with-stdin"


def server_script(target: SshTarget) -> str:
    """The POSIX sh script that starts rgpu-server on the host for an SSH session; the token is
    not in it: it follows on stdin (`--token-stdin`). Files: the user's home on the host (the
    server runs as the SSH user, with the same rights)."""
    args = SSH_SERVER_ARGS + ' --data-dir "home=$HOME"'
    if target.device:
        args += " --device " + shlex.quote(target.device)
    return launch_script(target.server_command, args)


def launch_script(server_command: str | None, args: str) -> str:
    """POSIX sh that runs `server_command ARGS`, else `rgpu-server` on PATH, else a python that
    has the rgpu_server module; else it prints RGPU_NO_SERVER and exits 127. `args` may end with
    redirections."""
    if server_command:
        return f"exec {server_command} {args}"
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

    def __init__(
        self, target: SshTarget, ssh: list[str], timeout: float, command: str | None = None
    ) -> None:
        """`command`: the remote command line that runs the server (default: `server_script`
        under `sh -c`); lines ``RGPU_NAME=value`` it prints before the server's go to `said`."""
        self.target = target
        self.token = secrets.token_urlsafe(32)
        self.said: dict[str, str] = {}
        command = command or "sh -c " + shlex.quote(server_script(target))
        # ClearAllForwardings: LocalForward lines of ~/.ssh/config must not be set up (or clash) here
        argv = [*ssh, "-T", "-o", "ClearAllForwardings=yes", "--", target.destination, command]
        self.process = popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # a Ctrl-C in the terminal must not end the server
        )
        self._stdout_lines: queue.Queue = queue.Queue()
        assert self.process.stdout is not None and self.process.stderr is not None
        self._stdout = Output(self.process.stdout, self._stdout_lines)
        self._stderr = Output(self.process.stderr)
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
            if line.startswith("RGPU_") and "=" in line:
                key, _, value = line.partition("=")
                self.said[key] = value
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
            raise ssh_error(dest, rc, said, "starting rgpu-server")
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
        terminate(self.process, close_stdin=True)


def terminate(p: subprocess.Popen, close_stdin: bool = False) -> None:
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
