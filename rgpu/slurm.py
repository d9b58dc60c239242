"""A GPU from a Slurm cluster: `rgpu.connect("slurm://user@login?partition=gpu&gres=gpu:1")`.

Over SSH to the login node, rgpu submits a batch job that runs `rgpu-server` on the compute node
(127.0.0.1, a free port, a fresh token from a 0600 file the job deletes before the server
starts), follows it with squeue until the server announces its port, and then opens an SSH
tunnel to the node through the login node (rgpu.ssh's `SshTunnel` with a jump host).
`SlurmTransport` is the session's transport: `ensure()` asks Slurm whether the job still runs
before every reconnect (a job that ended is `SessionLost`, in Slurm's words), `ended()` says why
a server went away, and `stop()` closes the tunnel and cancels the job. With `job=ID` it runs
the server as a step of a job of yours instead (`srun --overlap`), which it never cancels.
"""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from .config import DEFAULT, Config
from .errors import ConnectError, SessionLost
from .session import Session
from .slurm_job import SlurmJob
from .slurm_target import (
    JobState,
    NodeUnreachable,
    SlurmError,
    SlurmTarget,
    parse_slurm_url,
    step_command,
)
from .ssh import SshTunnel
from .ssh_process import RemoteServer
from .ssh_target import SshError, SshTarget

log = logging.getLogger("rgpu")

REMIND_S = 60.0  # a job still pending is reported again this often
ENDED_WAIT_S = 15.0  # how long `ended()` waits for Slurm to say a job whose server left ended

__all__ = ["SlurmTransport", "open_session", "parse_slurm_url"]


def minutes(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class SlurmTransport:
    """An rgpu-server in a Slurm job, and the SSH tunnel to it through the login node."""

    def __init__(
        self,
        target: str | SlurmTarget,
        *,
        timeout: float = 10.0,
        config: Config = DEFAULT,
        on_state: Callable[[str], None] | None = None,
        **options: Any,
    ) -> None:
        if isinstance(target, str):
            if options.get("ssh_command") is None:
                options["ssh_command"] = config.ssh_command
            target = parse_slurm_url(target, options)
        self.target = target
        self.config = config
        self.timeout = timeout
        self.on_state = on_state or (lambda line: log.info("rgpu: %s", line))
        self.job = SlurmJob(target, timeout)
        self.token: str | None = None
        self.node: str | None = None
        self.server: RemoteServer | None = None  # the step started in a job of yours
        self.tunnel: SshTunnel | None = None
        self.timings: dict[str, float] = {}  # seconds per phase of start(), for the curious
        self._stopped = threading.Event()
        self._lock = threading.RLock()

    @property
    def url(self) -> str:
        assert self.tunnel is not None
        return self.tunnel.url

    @property
    def alive(self) -> bool:
        return self.tunnel is not None and self.tunnel.alive

    def say(self, line: str) -> None:
        try:
            self.on_state(line)
        except Exception:  # a display must never break the connect
            log.debug("rgpu: on_state failed", exc_info=True)

    # -- start -------------------------------------------------------------------------------

    def start(self) -> str:
        """Get the job running and its server listening, open the tunnel; the URL to connect
        to. Ctrl-C (or any failure) on the way cancels the job."""
        _LIVE.add(self)
        try:
            self._start()
        except KeyboardInterrupt:
            self.stop()
            if self.job.id:
                self.say(f"cancelled {self.job}")
            raise
        except BaseException:
            self.stop()
            raise
        return self.url

    def _start(self) -> None:
        t0 = last = time.monotonic()

        def mark(phase: str) -> None:
            nonlocal last
            now = time.monotonic()
            self.timings[phase], last = now - last, now

        if self.target.job:
            port = self._start_step(mark)
        else:
            self.token = secrets.token_urlsafe(32)
            idle = self.target.idle
            self.job.submit(self.token, self.config.slurm_idle_seconds if idle is None else idle)
            mark("submit")
            self.say(f"submitted {self.job} to {self.job.login}")
            port = self._watch(mark)
        self.tunnel = self._open_tunnel(port)
        mark("tunnel")
        self.timings["total"] = time.monotonic() - t0
        threading.Thread(target=self._warn_loop, name="rgpu-slurm-warn", daemon=True).start()

    def _watch(self, mark: Callable[[str], None]) -> int:
        """Report the job's state as it changes (and again while it pends); its server's port."""
        shown = {"line": "", "at": time.monotonic()}

        def on_state(state: JobState) -> None:
            if state.state == "RUNNING" and "queue" not in self.timings:
                mark("queue")
            line = f"{self.job}: {state.describe()}"
            if line != shown["line"]:
                self.say(
                    line + ("; starting rgpu-server there" if state.state == "RUNNING" else "")
                )
                shown.update(line=line, at=time.monotonic())

        def remind() -> None:
            waited = time.monotonic() - shown["at"]
            if self.job.last.state == "PENDING" and waited >= REMIND_S:
                self.say(f"{self.job}: still {self.job.last.describe()} ({minutes(waited)})")
                shown["at"] = time.monotonic()

        self.node, port = self.job.watch(on_state, remind)
        mark("server")
        return port

    def _start_step(self, mark: Callable[[str], None]) -> int:
        """`job=ID`: wait until that job runs, then start rgpu-server as a step of it."""
        state = self.job.state()
        while state.state != "RUNNING":
            if state.ended:
                raise SlurmError(
                    f"{self.job} is not running ({state.describe()}): start rgpu-server in a "
                    "running job of yours, or leave job= out to submit one."
                )
            self.say(f"{self.job}: {state.describe()}; waiting for it to run")
            self._stopped.wait(2.0)
            state = self.job.state()
        mark("queue")
        self.say(f"{self.job}: RUNNING on {state.node}; starting rgpu-server in it (srun)")
        login = self.target.login
        try:
            self.server = RemoteServer(login, self.job.ssh, self.timeout,
                                       command=step_command(self.target, self.job.id or ""))  # fmt: skip
        except SshError:  # ssh itself failed, or no rgpu-server on the node
            raise
        except ConnectError as e:  # srun refused (a job that is not yours, not running...)
            raise SlurmError(f"could not start rgpu-server in {self.job}: {e}") from None
        self.token = self.server.token
        self.node = self.server.said.get("RGPU_NODE") or state.node
        mark("server")
        return self.server.port

    def _open_tunnel(self, port: int) -> SshTunnel:
        """The tunnel to the node's loopback port, through the login node."""
        login = self.target.login
        user = login.destination.rpartition("@")[0]
        node = f"{user}@{self.node}" if user else str(self.node)
        hop = SshTarget(destination=node, port=port, start="no", jump=login,
                        identity=login.identity, ssh_command=login.ssh_command)  # fmt: skip
        tunnel = SshTunnel(hop, token=self.token, timeout=self.timeout)
        try:
            tunnel.start()
        except SshError as e:
            raise NodeUnreachable(
                f"{self.job} runs rgpu-server on {self.node}, but {self.node} could not be reached "
                f"through {login.destination} over SSH ({e}). rgpu tunnels to the node with "
                f"`ssh -J {login.destination} {node}`: check that it works from this machine "
                "(some clusters allow ssh to a node only while you have a job on it; the node's "
                "host key must be known). The job is cancelled."
            ) from None
        return tunnel

    # -- the session's transport -------------------------------------------------------------

    def ensure(self) -> str:
        """The URL to use now. Raises `SessionLost` when the job (or the step) has ended, and
        `ConnectError` when the login node or the tunnel cannot be reached now (the caller
        retries)."""
        with self._lock:
            if self._stopped.is_set() or self.tunnel is None:
                raise ConnectError(f"the connection to {self.job} was closed")
            if self.server is not None and not self.server.alive:
                raise self._step_lost()
            state = self.job.state()
            if state.ended:
                raise self.ended(ENDED_WAIT_S) or self.job.lost(state)
            return self.tunnel.ensure()

    def ended(self, wait: float = ENDED_WAIT_S) -> SessionLost | None:
        """Why the server went away, once Slurm says the job ended (None if it still runs after
        `wait` seconds). The session calls it when the server closes with "going away"."""
        deadline = time.monotonic() + wait
        while not self._stopped.is_set():
            if self.server is not None and not self.server.alive:
                return self._step_lost()
            try:
                state = self.job.state()
            except ConnectError:
                return None
            # COMPLETING: its final state (CANCELLED, TIMEOUT...) follows; ?: squeue failed
            settling = state.state in ("COMPLETING", "?")
            if settling and time.monotonic() < deadline:
                time.sleep(0.5)
                continue
            if state.ended or (self.server is None and state.state not in ("RUNNING", "?")):
                return self.job.lost(state)
            if time.monotonic() > deadline:
                return None
            time.sleep(0.5)
        return None

    def _step_lost(self) -> SessionLost:
        assert self.server is not None
        return SessionLost(
            f"the rgpu-server step in {self.job} has exited: this session and every rgpu "
            "tensor in it are gone. Call rgpu.connect() to start a new one. Its last words:\n"
            + "\n".join(self.server.log().splitlines()[-5:])
        )

    def _warn_loop(self) -> None:
        """Warn once, `slurm_warn_seconds` before the job's time limit (asking Slurm again then:
        a limit can change)."""
        warn = self.config.slurm_warn_seconds
        left, at = self.job.last.time_left, self.job.last_at
        while left is not None and not self._stopped.is_set():
            if self._stopped.wait(max(0.0, at + left - warn - time.monotonic())):
                return
            try:
                state = self.job.state()
            except ConnectError:
                state = JobState("?")
            if state.state == "?":  # Slurm did not answer: trust the last time left
                state = JobState("RUNNING", time_left=left - (time.monotonic() - at))
            if state.ended:
                return
            left, at = state.time_left, time.monotonic()
            if left is not None and left <= warn + 1:
                log.warning(
                    "rgpu: %s on %s reaches its time limit in %s; every rgpu tensor of this "
                    "session is gone when it ends: save what you need now.",
                    self.job, self.node, minutes(left),
                )  # fmt: skip
                return

    def stop(self) -> None:
        """Close the tunnel, end the server and cancel the job (if rgpu submitted it).
        Idempotent."""
        self._stopped.set()
        self.job.cancel()  # first: it also ends a watch in progress
        with self._lock:
            if self.tunnel is not None:
                self.tunnel.stop()
            if self.server is not None:
                self.server.stop()
            _LIVE.discard(self)

    def describe(self) -> str:
        """One line for the user: the job, its node, and the tunnel."""
        how = "a step of your job" if self.target.job else "submitted by rgpu"
        local = self.tunnel.local_port if self.tunnel else "?"
        return f"127.0.0.1:{local} -> {self.job} on {self.node} ({how}) via {self.job.login}"


_LIVE: set[SlurmTransport] = set()


_PID = os.getpid()


@atexit.register
def _stop_all() -> None:
    """At exit, no job rgpu submitted outlives this process."""
    if os.getpid() != _PID:  # a forked child: the tunnels and jobs are its parent's
        return
    for transport in list(_LIVE):
        transport.stop()


def open_session(
    url: str,
    *,
    timeout: float = 10.0,
    options: Mapping[str, Any] | None = None,
    config: Config = DEFAULT,
    on_state: Callable[[str], None] | None = None,
    name: str | None = None,
    takeover: bool = False,
) -> Session:
    """A `Session` with an rgpu-server in a Slurm job (and a fresh token of its own); the job
    is its transport and ends with it (a named session too: it lives as long as the job)."""
    transport = SlurmTransport(url, timeout=timeout, config=config, on_state=on_state,
                               **dict(options or {}))  # fmt: skip
    transport.start()
    try:
        return Session(
            transport.url, token=transport.token, open_timeout=timeout, config=config,
            transport=transport, name=name, takeover=takeover,
        )  # fmt: skip
    except BaseException:
        transport.stop()
        raise
