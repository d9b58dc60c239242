"""Turning what a waited request answered into Python objects: rgpu tensors the server already
holds (trees of tensor metadata, as file loads and kept objects come back), and errors of the
request's own kind."""

from __future__ import annotations

from typing import Any

import torch

from rgpu_protocol import HostData, TensorMeta, tree

from . import current as _cur
from . import devices as _devices
from .errors import RemoteError
from .tensor import key_of_tensor_meta, wrap_with_id


def ask(msg: tuple, error: type[Exception], prefix: str = "rgpu.") -> Any:
    """One waited request; a refusal labelled `prefix...` is raised as `error` (its message
    alone), any other failure as the RemoteError it is."""
    try:
        # tensors a LOAD or KEPT makes are on the server's device 0 (rgpu:0 of the current
        # server), as `unpack_tensors` wraps them
        return _cur.current().request(msg, device=0 if _devices.MULTI else None)
    except RemoteError as e:
        if e.op.startswith(prefix):
            raise error(e.remote_message) from None
        raise


def unpack_tensors(wire: Any, first_id: int) -> Any:
    """A tree from the server with a RemoteTensor, under ids from `first_id` on, for each tensor
    it holds (`META` leaves), and a CPU tensor for each inline value (`HOST` leaves)."""
    sess = _cur.current()
    next_id = [first_id]

    def leaf(x: Any) -> Any:
        if type(x) is TensorMeta:
            w = wrap_with_id(sess, key_of_tensor_meta(x), next_id[0])
            next_id[0] += 1
            return w
        if type(x) is HostData:
            if not x.data:
                return torch.empty(x.shape, dtype=x.dtype)
            return torch.frombuffer(bytearray(x.data), dtype=x.dtype).reshape(x.shape)
        return x

    return tree.unpack(wire, leaf)
