"""Turning what a waited request answered into Python objects: rgpu tensors the server already
holds (trees of tensor metadata, as file loads and kept objects come back), and errors of the
request's own kind. Also which server a request goes to: with several servers, a request that
names tensors goes to the server holding them, and one that makes tensors to the server of the
device they are for."""

from __future__ import annotations

from typing import Any

import torch

from rgpu_protocol import HostData, TensorMeta, tree

from . import current as _cur
from . import devices as _devices
from .errors import RemoteError
from .tensor import RemoteTensor, key_of_tensor_meta, wrap_with_id

Session = Any  # an rgpu.session.Session


def ask(
    msg: tuple,
    error: type[Exception],
    prefix: str = "rgpu.",
    *,
    sess: Session | None = None,
    device: int | None = None,
) -> Any:
    """One waited request to `sess` (the current session if None), run on its server's device
    `device` (tensors a LOAD makes land there); a refusal labelled `prefix...` is raised as
    `error` (its message alone), any other failure as the RemoteError it is."""
    if sess is None:
        sess = _cur.current()
    try:
        return sess.request(msg, device=device)
    except RemoteError as e:
        if e.op.startswith(prefix):
            raise error(e.remote_message) from None
        raise


def device_session(device: Any = None) -> tuple[Session, int, int]:
    """(session, global index, index on its server) of an rgpu device ("rgpu", None: the
    current one): a request that makes tensors for it goes to that device's server."""
    fallback = _cur.current()  # connects first, if no one has yet
    index = _devices.index_of(device)
    sess, local = _devices.session_of(index, fallback)
    return sess, index, local


def holder(obj: Any, what: str) -> tuple[Session, int]:
    """(session, global device index) of the server that holds the rgpu tensors in the tree
    `obj`, where a request naming them must go (the current device's server when it holds none).
    Tensors of two servers cannot be named in one request: that raises, saying what to do."""
    sessions = _cur.sessions()
    if len(sessions) <= 1:
        sess, index, _ = device_session()
        return sess, index
    found: dict[int, tuple[Session, int]] = {}

    def leaf(x: Any) -> None:
        if isinstance(x, RemoteTensor):
            h = x._r
            found.setdefault(id(h.sess), (h.sess, h.dev))

    tree.pack(obj, leaf)
    if not found:
        sess, index, _ = device_session()
        return sess, index
    if len(found) > 1:
        (s1, d1), (s2, d2) = list(found.values())[:2]
        raise ValueError(
            f"{what} got tensors of two rgpu servers (rgpu:{d1} on {s1.url} and rgpu:{d2} on "
            f"{s2.url}); one server writes them, so they must all be on its devices: move them "
            f"there first (e.g. t.to('rgpu:{d1}')), or split the object per server"
        )
    return next(iter(found.values()))


def unpack_tensors(
    wire: Any, first_id: int, sess: Session, device: int = 0, devices: list[int] | None = None
) -> Any:
    """A tree from `sess`'s server with a RemoteTensor, under ids from `first_id` on, for each
    tensor it holds (`META` leaves), and a CPU tensor for each inline value (`HOST` leaves).
    The tensors are on global device `device`, or, with `devices`, the i-th on its server's
    device `devices[i]`."""
    base = getattr(sess, "device_base", 0)
    next_id = [first_id]

    def leaf(x: Any) -> Any:
        if type(x) is TensorMeta:
            i = next_id[0] - first_id
            dev = device if devices is None else base + devices[i]
            w = wrap_with_id(sess, key_of_tensor_meta(x), next_id[0], dev)
            next_id[0] += 1
            return w
        if type(x) is HostData:
            if not x.data:
                return torch.empty(x.shape, dtype=x.dtype, device="cpu")
            return torch.frombuffer(bytearray(x.data), dtype=x.dtype).reshape(x.shape)
        return x

    return tree.unpack(wire, leaf)
