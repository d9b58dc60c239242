"""GPU state that outlives this process: objects kept in a named session, found again later.

    rgpu.connect(url, session="llm")          # a named session: it stays when this process goes
    rgpu.keep("model", model)                 # a module, optimizer, scheduler, GradScaler, or
    rgpu.keep("opt", optimizer)               # containers of tensors and numbers
    ...                                        # (kernel restart)
    rgpu.connect(url, session="llm")          # the same token re-opens it
    model.load_state_dict(rgpu.kept("model"), assign=True)
    optimizer.load_state_dict(rgpu.kept("opt"))

rgpu tensors are kept by reference: no bytes move either way, and an in-place change after the
keep (a training step) is what `kept` returns. Everything else — numbers, and CPU tensors such as
an optimizer's step count — is recorded when `keep` is called: call it again after the steps you
want to resume from (it is one small message). `durable=True` also writes the object to the
server's disk, as it is then, so it survives a server restart. Kept tensors come back on the
device they were kept from. With several servers (`rgpu.connect([A, B])`) an object is kept by
the server that holds its tensors (all on one server), and `kept` finds a name on any of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rgpu_protocol import MAX_TREE_TENSORS, Kind, tree

from . import current as _cur
from .errors import RgpuError
from .replies import Session, ask, holder, unpack_tensors
from .tensor import RemoteTensor, reserve_ids

__all__ = ["SessionEntry", "drop_session", "forget", "keep", "kept", "sessions"]


class KeepError(RgpuError):
    """A keep, kept, forget or drop the server refused (the message says why)."""


def _ask(msg: tuple, sess: Session | None = None) -> Any:
    return ask(msg, KeepError, sess=sess)


_NOT_KEPT = "nothing is kept under"  # how the server starts the refusal of an unknown name


def _each_session(msg: tuple, every: bool = False) -> list[tuple[Session, Any]]:
    """(session, answer) of the first server (`every`: of each server) that knows the name
    `msg` asks about, the current one first; a refusal other than "nothing is kept" is raised,
    and so is the current session's when no server knows the name."""
    answers: list[tuple[Session, Any]] = []
    first: KeepError | None = None
    for sess in _cur.sessions() or [_cur.current()]:
        try:
            answers.append((sess, _ask(msg, sess)))
            if not every:
                break
        except KeepError as e:
            if not str(e).startswith(_NOT_KEPT):
                raise
            first = first or e
    if not answers and first is not None:
        raise first
    return answers


def _state_of(obj: Any) -> Any:
    """What is kept of `obj`: the state dict of anything that has one (a module, an optimizer, a
    scheduler, a GradScaler), containers as they are."""
    if isinstance(obj, (dict, list, tuple)) or isinstance(obj, torch.Tensor):
        return obj
    state_dict = getattr(obj, "state_dict", None)
    if callable(state_dict):
        return state_dict()
    return obj


def _leaf(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        if x.layout != torch.strided:
            raise TypeError(f"rgpu.keep keeps dense tensors, not {x.layout}")
        if not isinstance(x, RemoteTensor) and x.device.type != "cpu":
            raise TypeError(f"rgpu.keep keeps rgpu and CPU tensors, not {x.device.type} ones")
        return x.detach()
    if x is None or type(x) in (bool, int, float, complex, str, bytes, torch.dtype):
        return x
    if isinstance(x, torch.device):
        return str(x)
    raise TypeError(
        f"rgpu.keep keeps tensors, containers, numbers and strings (and the state dicts of "
        f"modules, optimizers, schedulers and GradScalers); a {type(x).__name__} is none of them"
    )


def keep(name: str, obj: Any, *, durable: bool = False) -> int:
    """Mark `obj` to be found again by a later client of this named session; the bytes of rgpu
    tensors it holds (kept by reference: nothing is copied or sent)."""
    state = _state_of(obj)
    sess, _ = holder(state, f"rgpu.keep({name!r})")
    held = _ask((Kind.KEEP, name, tree.pack(state, _leaf), bool(durable)), sess)
    for other in _cur.sessions():
        if other is not sess:  # the name now means this object: no other server's is found
            try:
                _ask((Kind.FORGET, name), other)
            except RgpuError:
                pass  # it kept nothing under the name (or is lost: its state goes with it)
    return held


def kept(name: str | None = None) -> Any:
    """The object kept under `name`, its rgpu tensors bound to the server's tensors (no bytes
    move); without a name, the names this session keeps."""
    if name is None:
        names = {
            n for s in _cur.sessions() or [_cur.current()] for n in _ask((Kind.KEPT, None, 0), s)
        }
        return sorted(names)
    first = reserve_ids(MAX_TREE_TENSORS)
    sess, reply = _each_session((Kind.KEPT, name, first))[0]
    if type(reply) is list and len(reply) == 2 and not _is_tagged(reply):
        wire, devices = reply  # each tensor's device index on its server
        return unpack_tensors(wire, first, sess, devices=devices)
    base = getattr(sess, "device_base", 0)  # an older server: the tree alone, on its device 0
    return unpack_tensors(reply, first, sess, base)


def _is_tagged(x: list) -> bool:
    return type(x[0]) is str and x[0] in (tree.DICT, tree.LIST, tree.TUPLE)


def forget(name: str) -> None:
    """Stop keeping `name` (and remove its copy on the server's disk)."""
    _each_session((Kind.FORGET, name), every=True)


@dataclass(frozen=True)
class SessionEntry:
    name: str | None
    session: str  # the start of its id
    state: str  # "live" or "detached"
    since: str
    tensors: int
    bytes: int
    kept: tuple[str, ...]
    seconds_left: float | None  # before a detached session is freed
    current: bool  # this process's session
    server: str = ""  # the URL of the server that holds it

    def describe(self) -> str:
        left = "" if self.seconds_left is None else f", {self.seconds_left / 3600:.1f} h left"
        return (f"{self.name or '(unnamed)'}: {self.state} since {self.since}, {self.tensors} "
                f"tensor(s), {self.bytes} bytes, kept: {', '.join(self.kept) or 'nothing'}{left}")  # fmt: skip


def sessions() -> list[SessionEntry]:
    """This token's sessions on every server of the device list (the current one's first)."""
    return [
        SessionEntry(
            e["name"],
            e["session"],
            e["state"],
            e["since"],
            e["tensors"],
            e["bytes"],
            tuple(e["kept"]),
            e["seconds_left"],
            e["current"],
            sess.url,
        )  # fmt: skip
        for sess in _cur.sessions() or [_cur.current()]
        for e in _ask((Kind.SESSIONS,), sess)
    ]


def drop_session(name: str) -> None:
    """End a named session of this token now, live or detached: its tensors and kept objects
    are freed (and its durable copies removed). The current session: `rgpu.disconnect(drop=True)`."""
    sess = _cur.get()
    if sess is not None and sess.name == name:
        _cur.disconnect(drop=True)
        return
    refused: KeepError | None = None
    for sess in _cur.sessions() or [_cur.current()]:  # with several servers: the one holding it
        try:
            _ask((Kind.DROP_SESSION, name), sess)
            return
        except KeepError as e:
            if "has no session named" not in str(e):
                raise
            refused = refused or e
    if refused is not None:
        raise refused
