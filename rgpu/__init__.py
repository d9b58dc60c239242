"""rgpu: a remote GPU as a PyTorch device.

    import torch, rgpu
    x = torch.ones(4, device="rgpu")
    print((x * 2).sum().item())   # 8.0, computed on the rgpu server

Importing registers the "rgpu" device and never touches the network; the first use connects
(to ``RGPU_SERVER``, or to an embedded local server when nothing is configured).
"""

from __future__ import annotations

from ._version import __version__
from .config import ConfigError
from .errors import (
    AuthError,
    ConnectError,
    ConnectionLost,
    NoSuchDevice,
    ProtocolViolation,
    RemoteError,
    RgpuError,
    SessionInUse,
    SessionLost,
)

__all__ = [
    "__version__",
    "connect",
    "disconnect",
    "stats",
    "session_info",
    "current_session",
    "device_list",
    "compile_backend",
    "settings",
    "Event",
    "keep",
    "kept",
    "forget",
    "sessions",
    "drop_session",
    "SessionInUse",
    "RemoteTensor",
    "RgpuError",
    "ConfigError",
    "RemoteError",
    "ConnectError",
    "AuthError",
    "ConnectionLost",
    "NoSuchDevice",
    "SessionLost",
    "ProtocolViolation",
]

from . import _registration
from . import generation as _generation
from .compile import compile_backend
from .current import connect, disconnect
from .current import current as _current
from .current import get as _get_session
from .current import sessions as _sessions
from .device_module import Event
from .devices import get as _get_devices
from .keeping import drop_session, forget, keep, kept, sessions
from .progress import settings
from .session import Counters
from .tensor import RemoteTensor

_registration.register()
_generation.install()


def stats() -> dict:
    """Counters of the current session: messages, waits, bytes, frames, wait_seconds, ...

    A *message* is one op or request in the stream; a *wait* is a point where this process
    blocked for the server's answer; `bytes_out` is what went on the wire (after any op-stream
    compression). Zeros when not connected. With several servers, the sum over their sessions.
    """
    sessions = _sessions()
    if not sessions:
        return Counters().as_dict()
    total = sessions[0].stats()
    for other in sessions[1:]:
        for k, v in other.stats().items():
            total[k] += v
    return total


def device_list() -> list[dict]:
    """The devices of the connected servers, rgpu:0 first: index, device, server (URL),
    server_device, name, state ("connected", "reconnecting", "lost", "closed"). Empty when not
    connected; never connects."""
    devices = _get_devices()
    return devices.describe() if devices is not None else []


def current_session():
    """The current `rgpu.session.Session` (url, device_name, state, ping(), ...) or None.

    Never connects.
    """
    return _get_session()


def session_info() -> dict:
    """What the server holds for this session: tensors, bytes, ops run (one wait)."""
    return _current().info()
