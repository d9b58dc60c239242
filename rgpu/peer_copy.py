"""Copies between devices of two different servers: server to server, not through this process.

The source server snapshots the tensor under a fresh one-time capability (EXPORT) and the
destination server fetches it from the source's URL with that capability (IMPORT), so only two
small messages leave the client (rgpu_protocol/peer.py says how the servers talk). Neither waits:
both streams stay asynchronous, and a failure poisons the destination like a failed op.
The servers must reach each other at the URLs this client uses for them.
"""

from __future__ import annotations

import secrets
from typing import Any

import torch

from rgpu_protocol import Kind, dense_strides
from rgpu_protocol.peer import CAPABILITY_BYTES

from . import tensor as _tensor
from .devices import local_index
from .dispatch import dispatch
from .tensor import RemoteTensor

aten = torch.ops.aten


def copy_into(dst: RemoteTensor, src: RemoteTensor) -> RemoteTensor:
    """`dst.copy_(src)` where the two live on different servers."""
    _tensor.check_copy_fits(dst, src, "between rgpu devices")
    src_sess, dst_sess = src._r.sess, dst._r.sess
    src_sess.check_usable()
    dst_sess.check_usable()
    capability = secrets.token_bytes(CAPABILITY_BYTES)
    src_sess.post((Kind.EXPORT, src, capability), device=local_index(src._r))
    src_sess.flush()  # the destination's server is about to ask for it
    dst_sess.post((Kind.IMPORT, dst, src_sess.url, capability), device=local_index(dst._r))
    return dst


def to_device(x: RemoteTensor, index: int, kwargs: dict) -> RemoteTensor:
    """`x.to("rgpu:<index>")` where device `index` is on another server than x."""
    dtype = kwargs.get("dtype") or x.dtype
    shape, stride = tuple(x.shape), x.stride()
    device = torch.device(_tensor.DEVICE_TYPE, index)
    memory_format = kwargs.get("memory_format")
    if dense_strides(shape, stride) and memory_format in (None, torch.preserve_format):
        out = dispatch(
            aten.empty_strided.default, (shape, stride), {"dtype": dtype, "device": device}
        )
    else:
        out = dispatch(aten.empty.memory_format, (shape,), {"dtype": dtype, "device": device,
                                                            "memory_format": memory_format})  # fmt: skip
    return copy_into(out, x)


def crosses_servers(a: Any, b: Any) -> bool:
    """Whether two rgpu tensors live on different servers."""
    return type(a) is RemoteTensor and type(b) is RemoteTensor and a._r.sess is not b._r.sess
