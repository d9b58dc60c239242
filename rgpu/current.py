"""The process's current session: `connect`, `disconnect`, and the lazy connect on first use."""

from __future__ import annotations

import atexit
import logging
import sys
import threading
from collections.abc import Mapping
from typing import Any

from rgpu_protocol import DEFAULT_SEED, Kind

from . import progress, slurm, ssh
from .config import Config
from .errors import ConnectError
from .local_server import EmbeddedServer
from .session import Session

log = logging.getLogger("rgpu")

_current: Session | None = None
_lock = threading.RLock()
_pending_seed: int | None = None


def announce(message: str) -> None:
    """One line for the user: through logging when it is configured, else on stderr."""
    if logging.getLogger().handlers or log.handlers:
        log.info(message)
    else:
        print(f"rgpu: {message}", file=sys.stderr)


def _normalise_url(url: str) -> str:
    if "://" not in url:
        url = "ws://" + url  # "host:port" shorthand
    scheme = url.split("://", 1)[0].lower()
    if scheme not in ("ws", "wss"):
        raise ConnectError(
            f"rgpu servers are reached over ws:// or wss:// (or ssh://, slurm://), not "
            f"{scheme}:// ({url})"
        )
    return url


def connect(
    url: str | None = None,
    *,
    token: str | None = None,
    timeout: float = 10.0,
    ssh_options: Mapping[str, Any] | None = None,
    slurm_options: Mapping[str, Any] | None = None,
) -> Session:
    """Connect to an rgpu server and make it the current session.

    `url` is ``ws://host:port`` (or ``wss://``), ``host:port``, ``"local"`` to start an embedded
    server on this machine, or ``ssh://user@host[:sshport]`` to tunnel to a GPU host over SSH,
    starting a server there if none runs (query or `ssh_options`: port, identity, start, device,
    server_command, token_file, ssh_command; see rgpu.ssh), or
    ``slurm://user@login-host?partition=gpu&gres=gpu:1&time=02:00:00`` to run the server as a
    Slurm job and tunnel to its node through the login node (query or `slurm_options`:
    partition, gres, gpus, cpus, mem, time, account, qos, constraint, sbatch, server_command,
    device, job, idle, workdir, identity, ssh_command; see rgpu.slurm): the job's state is shown
    while it waits, Ctrl-C cancels it, and disconnecting cancels it. Without `url`,
    ``RGPU_SERVER`` is used, and without that, ``"local"``.
    `token` defaults to ``RGPU_TOKEN`` (a slurm:// job makes its own). Connecting again ends the
    previous session, and with it every rgpu tensor it held.
    """
    global _current
    with _lock:
        config = Config.from_env()
        target = url or config.server or "local"
        scheme = target.split("://", 1)[0].lower() if "://" in target else ""
        if scheme == "slurm" and token is not None:
            raise ConnectError("a slurm:// job makes its own token: leave token= out")
        if token is None and "token=" not in target and scheme != "slurm":  # ?token= beats env
            token = config.token
        if target == "local":
            server = EmbeddedServer(device=config.local_device or "auto")
            try:
                session = Session(
                    server.url,
                    token=server.token,
                    open_timeout=timeout,
                    config=config,
                    local_process=server,
                )
            except BaseException:
                server.stop()
                raise
            announce(
                f"started an embedded rgpu server at {server.url} on {session.device} "
                f"({session.device_name}); set RGPU_SERVER or call rgpu.connect(url) to use a remote GPU"
            )
        elif scheme == "slurm":
            session = slurm.open_session(
                target, timeout=timeout, options=slurm_options, config=config, on_state=announce
            )
            announce(f"connected through Slurm: {session.transport.describe()}")
        elif scheme == "ssh":
            session = ssh.open_session(
                target, token=token, timeout=timeout, options=ssh_options, config=config
            )
            if session.transport.server is not None:
                announce(f"connected over SSH: {session.transport.describe()}")
        else:
            session = Session(
                _normalise_url(target), token=token, open_timeout=timeout, config=config
            )
        if _pending_seed is not None:
            session.post((Kind.SEED, _pending_seed))
        # the old session ends only now: a mistyped URL does not cost the user their tensors
        disconnect()
        _current = session
        progress.use_config(config)
        _warm_up()
        return session


def _warm_up() -> None:
    """Import what the first meta inference needs (~0.5 s) now, at connect, rather than in the
    user's first op. Not on a thread: a daemon thread inside torch when the interpreter exits
    aborts the process."""
    import torch

    try:
        torch.empty(2, device="meta").add(1).relu().sum()
    except Exception:
        pass


def disconnect() -> None:
    """End the current session (its rgpu tensors become unusable) and stop an embedded server."""
    global _current
    with _lock:
        session, _current = _current, None
        if session is not None:
            session.close()


def current() -> Session:
    """The current session, connecting on first use."""
    session = _current
    if session is None:
        with _lock:
            session = _current or connect()
    return session


def get() -> Session | None:
    """The current session, or None; never connects."""
    return _current


def initial_seed() -> int:
    """The seed last given to this session's generator (torch's default seed if none was)."""
    return _pending_seed if _pending_seed is not None else DEFAULT_SEED


def seed(value: int) -> None:
    """Seed the server's generator for this session now, or at connect if not connected yet."""
    global _pending_seed
    with _lock:
        _pending_seed = value
        if _current is not None and not _current.closed:
            _current.post((Kind.SEED, value))


atexit.register(disconnect)
