"""KEEP, KEPT, FORGET, SESSIONS, DROP_SESSION: what a named session keeps for a later client.

A kept object is its tree (rgpu_protocol.tree) with each tensor replaced by a placeholder, and
the session's tensors themselves, held by reference: a later in-place change (a training step) is
what the next client finds. Each tensor's device index is kept with it, so that KEPT gives it
back on that device (virtual devices cannot be told apart by the tensor itself). Values that were
CPU tensors on the client (an optimizer's step count) are stored as their bytes, as they were
when kept. `durable` also writes the object to the state directory (durable.py), as it is at
that moment.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from rgpu_protocol import HostData, ProtocolError, Status, TensorMeta, byte_view, tree
from rgpu_protocol.handshake import NAME_RULE, valid_session_name

from . import multidevice
from .poison import Poison
from .state import SessionState

MAX_KEPT = 256  # names one session keeps


@dataclass
class Kept:
    wire: Any  # the tree; a TensorMeta leaf stands for the next of `tensors`
    tensors: list = field(default_factory=list)
    devices: list[int] = field(default_factory=list)  # the device index of each tensor
    durable: bool = False
    on_disk_only: bool = False  # restored after a server restart: read when first asked for


def _meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(t.dtype, tuple(t.shape), t.stride(), t.storage_offset(), t.is_conj(),
                      t.is_neg())  # fmt: skip


def _error(s: SessionState, seq: int, what: str, message: str) -> None:
    s.reply(seq, Status.ERROR, [f"rgpu.{what}", message])


def keep(s: SessionState, seq: int, msg: list) -> None:
    _, name, wire, durable = msg
    if s.error_pending(seq):
        return
    if s.name is None:
        _error(s, seq, "keep", "rgpu.keep needs a named session, which outlives its client: "
               "connect with rgpu.connect(url, session='NAME') (or RGPU_SESSION)")  # fmt: skip
        return
    if not valid_session_name(name):
        _error(s, seq, "keep", f"{name!r} is not a name to keep under: use {NAME_RULE}")
        return
    if s.bad is not None:
        bad = s.bad
        message = bad.message if type(bad) is Poison else s.missing_message()
        _error(s, seq, "keep", f"cannot keep {name!r}: {message}")
        return
    if name not in s.kept and len(s.kept) >= MAX_KEPT:
        _error(s, seq, "keep", f"this session keeps {MAX_KEPT} names already; forget some")
        return
    if durable and s.store is None:
        _error(s, seq, "keep", "durable=True needs a server started with --state-dir DIR")
        return
    tensors: list[torch.Tensor] = []
    devices: list[int] = []

    def leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            tid = s.refs.get(id(x))
            if tid is not None:  # a tensor of this session: kept by reference
                tensors.append(x)
                devices.append(multidevice.index_of_tensor(s, x, tid))
                return _meta(x)
            t = x.detach().contiguous()  # a CPU value of the client's: kept as it is now
            return HostData(t.dtype, tuple(t.shape), bytes(byte_view(t)))
        if x is None or type(x) in (bool, int, float, complex, str, bytes, torch.dtype):
            return x
        raise ProtocolError(f"a kept tree leaf of type {type(x).__name__}")

    stored = tree.map_leaves(wire, leaf)
    kept = Kept(stored, tensors, devices, durable)
    previous = s.kept.get(name)
    s.kept[name] = kept
    registry = s.registry
    if registry is not None and registry.max_detached is not None:
        held = registry.detached_bytes(but=s) + s.memory()[1]
        if held > registry.max_detached:
            if previous is None:
                del s.kept[name]
            else:
                s.kept[name] = previous
            _error(s, seq, "keep", f"keeping {name!r} would let detached sessions hold {held} "
                   f"bytes, past this server's --max-detached-mb ({registry.max_detached} bytes): "
                   "free tensors, or forget what you no longer need")  # fmt: skip
            return
    if durable:
        s.store.write(s.owner, s.name, name, stored, tensors, devices, s.generator.get_state())
    s.reply(seq, Status.OK, sum(t.untyped_storage().nbytes() for t in tensors))


def kept(s: SessionState, seq: int, msg: list) -> None:
    _, name, first_id = msg
    if s.error_pending(seq):
        return
    if name is None:
        s.reply(seq, Status.OK, sorted(s.kept))
        return
    entry = s.kept.get(name)
    if entry is None:
        where = ", ".join(sorted(s.kept)) or "nothing"
        _error(
            s, seq, "kept", f"nothing is kept under {name!r} in this session (it keeps: {where})"
        )
        return
    if entry.on_disk_only:
        entry.wire, entry.tensors, entry.devices = s.store.read(s.owner, s.name, name, s.devices)
        entry.on_disk_only = False
    tensors = iter(zip(entry.tensors, entry.devices, strict=True))
    ids: list[int] = []
    devices: list[int] = []

    def leaf(x: Any) -> Any:
        if type(x) is TensorMeta:
            t, index = next(tensors)
            tid = first_id + len(ids)
            multidevice.store(s, tid, t, index)
            ids.append(tid)
            devices.append(index)
            return _meta(t)
        return x

    wire = tree.map_leaves(entry.wire, leaf)
    if s.quota is not None and not s.charge("rgpu.kept", ids, report=False):
        for tid in ids:
            s.tensors.pop(tid, None)
        _error(s, seq, "kept", s.quota.message())
        return
    s.reply(seq, Status.OK, [wire, devices])


def forget(s: SessionState, seq: int, msg: list) -> None:
    if s.error_pending(seq):
        return
    entry = s.kept.pop(msg[1], None)
    if entry is None:
        _error(s, seq, "forget", f"nothing is kept under {msg[1]!r}")
        return
    if entry.durable and s.store is not None:
        s.store.forget(s.owner, s.name, msg[1])
    s.reply(seq, Status.OK, None)


def sessions(s: SessionState, seq: int, msg: list) -> None:
    if s.error_pending(seq):
        return
    registry = s.registry
    listing = registry.listing(s.owner, time.monotonic()) if registry is not None else []
    for entry in listing:
        entry["current"] = entry["session"] == s.id.hex()[:8]
    s.reply(seq, Status.OK, listing)


def drop_session(s: SessionState, seq: int, msg: list) -> None:
    if s.error_pending(seq):
        return
    name = msg[1]
    if name == s.name:
        _error(s, seq, "drop_session", f"{name!r} is this session: end it with "
               "rgpu.disconnect(drop=True)")  # fmt: skip
        return
    registry = s.registry
    if registry is None or registry.find(s.owner, name) is None:
        _error(s, seq, "drop_session", f"this token has no session named {name!r}")
        return
    registry.drop_from_worker(s.owner, name)
    s.reply(seq, Status.OK, None)
