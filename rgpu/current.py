"""The process's current session: `connect`, `disconnect`, and the lazy connect on first use.

`connect` may be given several servers (a list, or URLs separated by commas): their devices
become one device list (rgpu.devices), and the first server's session is the current one.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import sys
import threading
from collections.abc import Mapping
from typing import Any

from rgpu_protocol import DEFAULT_SEED, Kind

from . import devices, numerics, progress, slurm, ssh
from .config import Config
from .errors import ConnectError, RgpuError, hint
from .local_server import EmbeddedServer
from .session import Session

log = logging.getLogger("rgpu")

_current: Session | None = None
_others: list[Session] = []  # the sessions of the other servers of the device list
_lock = threading.RLock()
_pending_seed: int | None = None
_disconnected = False  # rgpu.disconnect() was called: no automatic connect until connect()


def announce(message: str) -> None:
    """One line for the user: through logging when it is configured, else on stderr (stdout in
    a notebook, where stderr shows as an alarm and lands after the cell's other lines)."""
    if logging.getLogger().handlers or log.handlers:
        log.info(message)
    else:
        print(f"rgpu: {message}", file=sys.stdout if _in_ipython() else sys.stderr, flush=True)


def _in_ipython() -> bool:
    ipython = sys.modules.get("IPython")
    return ipython is not None and ipython.get_ipython() is not None


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


_NEXT_URL = re.compile(r",\s*(?=(?:wss?|ssh|slurm)://|local\b|[\w.\[\]:-]+:\d+)")


def split_targets(target: str | list | tuple) -> list[str]:
    """Several servers: a list, or URLs separated by commas (as in RGPU_SERVER)."""
    if isinstance(target, (list, tuple)):
        return [str(t) for t in target]
    return [t.strip() for t in _NEXT_URL.split(target) if t.strip()]


def connect(
    url: str | list[str] | None = None,
    *,
    token: str | None = None,
    timeout: float = 10.0,
    ssh_options: Mapping[str, Any] | None = None,
    session: str | None = None,
    takeover: bool = False,
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

    Several servers (``rgpu.connect([url_a, url_b])``, or URLs separated by commas here and in
    ``RGPU_SERVER``) become one device list: server A's devices are rgpu:0.., then server B's
    follow. A different token per server goes in each URL (``?token=``).

    `session` (default ``RGPU_SESSION``) opens a *named* session, or re-opens one a client of the
    same token left (a kernel restart, a killed process): it outlives this process on the server
    (``--detached-ttl``, a day by default), and what `rgpu.keep` marked in it is found again with
    `rgpu.kept`. A named session another live client holds is refused (`rgpu.SessionInUse`)
    unless `takeover` is true; that client then gets `SessionLost`.
    """
    global _current, _others, _forked_from
    with _lock:
        _forked_from = None  # a forked child connecting for itself
        config = Config.from_env()
        name = session if session is not None else config.session
        targets = split_targets(url or config.server or "local")
        if not targets:
            raise ConnectError("rgpu.connect was given no server")
        if name is not None and _current is not None and _current.name == name:
            for held in (_current, *_others):
                held.close()  # this process holds it: leave it, then open it again below
        opened_all: list[Session] = []
        try:
            for target in targets:
                opened_all.append(_open(target, token, timeout, ssh_options, slurm_options,
                                        config, name, takeover))  # fmt: skip
            _check_distinct(opened_all)
        except BaseException:
            for s in opened_all:
                s.close()
            raise
        for opened in opened_all:
            if _pending_seed is not None and not opened.welcome.attached:
                opened.post((Kind.SEED, _pending_seed))  # a re-opened session keeps its generator
            if numerics.CHANGES:  # torch's numeric settings changed before this connect
                opened.post(numerics.message())
        # the old session ends only now: a mistyped URL does not cost the user their tensors
        disconnect()
        _current, _others = opened_all[0], opened_all[1:]
        devices.install(devices.DeviceList(opened_all))
        _set_disconnected(False)
        progress.use_config(config)
        _warm_up()
        return _current


def _check_distinct(opened: list[Session]) -> None:
    seen = {}
    for s in opened:
        sid = s.welcome.server_id
        if sid and sid in seen:
            raise ConnectError(f"{seen[sid]} and {s.url} are the same rgpu server; list it once")
        seen[sid] = s.url


def _open(
    target: str,
    token: str | None,
    timeout: float,
    ssh_options: Mapping[str, Any] | None,
    slurm_options: Mapping[str, Any] | None,
    config: Config,
    name: str | None,
    takeover: bool,
) -> Session:
    """A session with one server (a URL, "local", ssh:// or slurm://)."""
    scheme = target.split("://", 1)[0].lower() if "://" in target else ""
    if scheme == "slurm" and token is not None:
        raise ConnectError("a slurm:// job makes its own token: leave token= out")
    if token is None and "token=" not in target and scheme != "slurm":  # ?token= beats env
        token = config.token
    if target == "local":
        server = EmbeddedServer(device=config.local_device or "auto", threads=config.local_threads)
        try:
            opened = Session(
                server.url,
                token=server.token,
                open_timeout=timeout,
                config=config,
                local_process=server,
                name=name,
                takeover=takeover,
            )
        except BaseException:
            server.stop()
            raise
        announce(hint(
            f"started an embedded rgpu server at {server.url} on {opened.device} "
            f"({opened.device_name}); set RGPU_SERVER or call rgpu.connect(url) to use a remote GPU"
        ))  # fmt: skip
    elif scheme == "slurm":
        opened = slurm.open_session(
            target, timeout=timeout, options=slurm_options, config=config, on_state=announce,
            name=name, takeover=takeover,
        )  # fmt: skip
        announce(f"connected through Slurm: {opened.transport.describe()}")
    elif scheme == "ssh":
        opened = ssh.open_session(
            target, token=token, timeout=timeout, options=ssh_options, config=config,
            name=name, takeover=takeover,
        )  # fmt: skip
        if opened.transport.server is not None:
            announce(f"connected over SSH: {opened.transport.describe()}")
    else:
        opened = Session(
            _normalise_url(target), token=token, open_timeout=timeout, config=config,
            name=name, takeover=takeover,
        )  # fmt: skip
    return opened


_warming: list[threading.Thread] = []


def _warm_up() -> None:
    """Import what the first meta inference needs (torch imports Dynamo for it: 1-2 s) in the
    background, while the user does something else, rather than in their first op or in
    connect. Joined at exit: a thread still inside torch when the interpreter finalizes aborts
    the process."""
    if _warming:
        return

    def work() -> None:
        import _imp

        import torch

        # Holding the interpreter's import lock makes another thread's imports wait for these
        # rather than interleave with them: `torch.compile` right after `connect` imports
        # Dynamo too, and the two half-done imports of its circular modules failed there
        # (_DeadlockError, or "partially initialized module").
        _imp.acquire_lock()
        try:
            torch.empty(2, device="meta").add(1).relu().sum()
        except Exception:
            pass
        finally:
            _imp.release_lock()

    thread = threading.Thread(target=work, name="rgpu-warm-up", daemon=True)
    _warming.append(thread)
    thread.start()


@atexit.register
def _join_warm_up() -> None:
    for thread in _warming:
        thread.join(timeout=60)


def disconnect(drop: bool = False) -> None:
    """End the current session (its rgpu tensors become unusable) and stop an embedded server.
    A named session is left on the server for a later client, unless `drop`. Until the next
    `connect`, using the device raises instead of starting a server."""
    global _current, _others
    with _lock:
        session, _current = _current, None
        others, _others = _others, []
        if session is not None:
            devices.install(None)
            for s in (session, *others):
                s.close(drop=drop)
            _set_disconnected(True)


_forked_from: int | None = None  # set in a forked child of a connected process


def _forget_in_forked_child() -> None:
    """A forked child shares the parent's sockets: closing its sessions at exit ended the
    parent's session on the server, and a wait on them never returned. The child forgets them
    without touching them; using rgpu there raises until the child connects for itself."""
    global _current, _others, _lock, _forked_from
    _lock = threading.RLock()  # a parent's thread may have held it; that thread is not here
    if _current is None:
        return
    _current, _others = None, []
    _forked_from = os.getppid()
    devices.install(None)


os.register_at_fork(after_in_child=_forget_in_forked_child)


def _set_disconnected(value: bool) -> None:
    global _disconnected
    _disconnected = value


def current() -> Session:
    """The current session, connecting on first use."""
    session = _current
    if session is None:
        with _lock:
            if _current is None and _forked_from is not None:
                raise RgpuError(
                    f"this process was forked from one (pid {_forked_from}) connected to rgpu, "
                    "whose session stays the parent's: a forked child cannot use it, as CUDA "
                    "cannot be used in a forked subprocess. Start workers with 'spawn' "
                    "(multiprocessing.get_context('spawn'), DataLoader(multiprocessing_context="
                    "'spawn')), or call rgpu.connect(...) in the child for a session of its own"
                )
            if _current is None and _disconnected:
                raise RgpuError(
                    "rgpu is disconnected (rgpu.disconnect()); connect again with rgpu.connect() "
                    "(%rgpu connect in a notebook) to use the device"
                )
            session = _current or connect()
    return session


def get() -> Session | None:
    """The current session, or None; never connects."""
    return _current


def sessions() -> list[Session]:
    """Every session of the device list: the current one first (none when not connected)."""
    return [_current, *_others] if _current is not None else []


def initial_seed() -> int:
    """The seed last given to this session's generator (torch's default seed if none was)."""
    return _pending_seed if _pending_seed is not None else DEFAULT_SEED


def seed(value: int) -> None:
    """Seed the server's generator for this session now, or at connect if not connected yet."""
    global _pending_seed
    with _lock:
        _pending_seed = value
        for s in (_current, *_others) if _current is not None else ():
            if not s.closed and s.broken is None:
                s.post((Kind.SEED, value))


atexit.register(disconnect)
