"""The client's devices: rgpu:0..N-1 over one server or several, the current device, and which
device (so which session) each op runs on.

The devices of the connected servers are numbered in connection order (`DeviceList`): server A's
four devices are rgpu:0..3, server B's two rgpu:4..5. A tensor's `Handle` carries its device
index (`Handle.dev`) and its server's session; the wrapper's `.device` says `rgpu:<dev>`. As on
CUDA, an op runs on the device of its tensors (all on one device: mixing raises here, on the
user's line, with CUDA's message), a factory on its `device=` argument, and `"rgpu"` without an
index means the current device (per thread, `torch.rgpu.set_device`, `torch.rgpu.device(i)`).
`copy_` and `.to("rgpu:k")` are the ops that cross devices; on one server they run there, between
servers they go from server to server (rgpu/peer_copy.py).

With one device nothing here runs per op (`MULTI` is False). Backward runs in the thread that
called it (rgpu.backward_errors), which several devices need too: PyTorch gives a Python backend
one autograd device thread, and engine.cpp asserts on a device index past it.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from . import tensor as _tensor
from .errors import NoSuchDevice, shown_briefly
from .tensor import RemoteTensor

Session = Any  # an rgpu.session.Session

MULTI = False  # more than one device: ops are routed (route) and devices checked
_list: DeviceList | None = None
_local = threading.local()  # .index: this thread's current device
_copy = torch.ops.aten.copy_.default


class DeviceList:
    """Every device of the connected servers: global index -> (session, index on its server)."""

    def __init__(self, sessions: list[Session]) -> None:
        self.sessions = list(sessions)
        self.entries: list[tuple[Session, int]] = []
        self.names: list[tuple[str, str]] = []  # (server device, name) per global index
        for s in self.sessions:
            s.device_base = len(self.entries)
            for local, pair in enumerate(s.welcome.device_list):
                self.entries.append((s, local))
                self.names.append(pair)

    def __len__(self) -> int:
        return len(self.entries)

    def describe(self) -> list[dict]:
        """One line of facts per device, for `%rgpu status` and the widget."""
        return [
            {"index": i, "device": f"rgpu:{i}", "server": s.url, "server_device": d,
             "name": name, "state": s.state}
            for i, ((s, _), (d, name)) in enumerate(zip(self.entries, self.names))
        ]  # fmt: skip


def install(devices: DeviceList | None) -> None:
    """Make `devices` the process's devices (None: not connected)."""
    global _list, MULTI
    _list = devices
    n = len(devices) if devices is not None else 1
    _tensor.DEVICES = [torch.device(_tensor.DEVICE_TYPE, i) for i in range(max(n, 1))]
    MULTI = n > 1
    if _current_index() >= n:
        _local.index = 0


def get() -> DeviceList | None:
    return _list


def count() -> int:
    """Devices of the connected servers (1 when not connected)."""
    return len(_list) if _list is not None else 1


def _current_index() -> int:
    return getattr(_local, "index", 0)


def current() -> int:
    """This thread's current device index."""
    return _current_index()


def check_index(index: int, what: str = "") -> int:
    """`index` if such a device exists, else the error CUDA gives for a bad ordinal, in words."""
    n = count()
    if not isinstance(index, int) or not 0 <= index < n:
        listed = "rgpu:0" if n == 1 else f"rgpu:0 to rgpu:{n - 1}"
        raise NoSuchDevice(
            f"{what or f'rgpu:{index}'} does not exist: the connected rgpu server"
            f"{'s have' if _list is not None and len(_list.sessions) > 1 else ' has'} {n} "
            f"device{'s' if n != 1 else ''} ({listed}); torch.rgpu.device_count() says how many"
        )
    return index


def index_of(device: Any) -> int:
    """The device index `device` names (an int, "rgpu:i", a torch.device; "rgpu" and None mean
    the current device), checked."""
    if device is None:
        return current()
    if isinstance(device, int):
        return check_index(device)
    d = torch.device(device)
    if d.type != _tensor.DEVICE_TYPE:
        raise ValueError(f"{device!r} is not an rgpu device")
    return current() if d.index is None else check_index(d.index, str(d))


# rgpu.current_device.install, wired in by rgpu._registration: the calls whose device PyTorch
# resolves in C++ learn the current device once it is not rgpu:0
on_other_device: Any = None


def set_current(index: int) -> None:
    if index and on_other_device is not None:
        on_other_device()
    _local.index = index


def session_of(index: int, fallback: Session) -> tuple[Session, int]:
    """(session, index on its server) of device `index`."""
    if _list is None:
        return fallback, index
    return _list.entries[index]


def local_index(h: Any) -> int:
    """The index on its own server of the device a handle's tensor is on."""
    return h.dev - getattr(h.sess, "device_base", 0)


def route(func: Any, args: tuple, kwargs: dict, fallback: Session) -> tuple[Session, int, int]:
    """(session, device index, index on its server) an op runs on; raises when it mixes
    tensors of two devices (copy_ may: it runs on its destination's device)."""
    dev = -1
    device = kwargs.get("device") if kwargs else None
    if device is not None:
        if type(device) is not torch.device:
            device = torch.device(device)
        if device.type == _tensor.DEVICE_TYPE:
            dev = current() if device.index is None else check_index(device.index, str(device))
    if dev < 0:
        if func is _copy and type(args[0]) is RemoteTensor:
            dev = args[0]._r.dev
        else:
            dev = _common(args, kwargs)
    sess, local = _list.entries[dev] if _list is not None else (fallback, dev)
    return sess, dev, local


def _common(args: tuple, kwargs: dict) -> int:
    found = -1
    for a in (*args, *kwargs.values()) if kwargs else args:
        t = type(a)
        if t is RemoteTensor:
            found = _same(found, a._r.dev)
        elif t is list or t is tuple:
            for y in a:
                if type(y) is RemoteTensor:
                    found = _same(found, y._r.dev)
    return found if found >= 0 else current()


def _same(found: int, dev: int) -> int:
    if found >= 0 and dev != found:
        raise shown_briefly(
            RuntimeError(
                "Expected all tensors to be on the same device, but found at least two "
                f"devices, rgpu:{found} and rgpu:{dev}!"
            )
        )
    return dev
