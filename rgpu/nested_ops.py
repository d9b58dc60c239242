"""The nested tensors of `nn.TransformerEncoder`'s fast path, held on the server.

In eval mode, with no grad and a `src_key_padding_mask`, `TransformerEncoder` packs its input
into a nested tensor (`_nested_tensor_from_mask`), runs each layer's fused kernel on it
(`_transformer_encoder_layer_fwd`) and pads the result back (`to_padded_tensor`); PyTorch takes
this path on every accelerator, rgpu included. A nested tensor has no one shape, so the client
cannot describe it: the server keeps the real one, and the client's wrapper carries the padded
shape with the NESTED flag in its key. Those three ops are the only ones that accept it; every
other op refuses it at the call (`keys.meta_of_key`), so the server's values are the CPU's (or
CUDA's) own, padding included.
"""

from __future__ import annotations

from typing import Any

import torch

from rgpu_protocol import Kind, TensorMeta

from . import current as _cur
from . import devices as _devices
from .dispatch import run_dynamic
from .keys import NESTED, new_storage_key
from .special_ops import generic
from .tensor import RemoteTensor, wrap

aten = torch.ops.aten
_RUN = int(Kind.RUN)


def is_nested(x: Any) -> bool:
    return isinstance(x, RemoteTensor) and bool(x._r.key[5] & NESTED)


def _route(func: Any, args: tuple, kwargs: dict) -> tuple[Any, int, int | None]:
    sess = _cur._current or _cur.current()
    if _devices.MULTI:
        return _devices.route(func, args, kwargs, sess)
    return sess, 0, None


def _post(func: Any, info: Any, args: tuple, kwargs: dict, key: tuple, expect: bool) -> Any:
    sess, dev, where = _route(func, args, kwargs)
    out = wrap(sess, key, dev)
    msg: tuple = (_RUN, info.wire, args, kwargs or None, [out._r.id])
    if expect:
        dtype, shape, stride, offset = key[:4]
        msg = (*msg, [TensorMeta(dtype, shape, stride, offset, False, False)])
    sess.post(msg, device=where)
    return out


def _contiguous(shape: tuple) -> tuple:
    return torch.empty(shape, device="meta").stride()


def _padded_key(x: RemoteTensor) -> tuple:
    """A contiguous layout of `x`'s padded shape, flagged as the server's nested tensor."""
    shape = tuple(x.shape)
    dense = new_storage_key(x.dtype, shape, _contiguous(shape), 0)
    return (*dense[:5], NESTED)


def _from_mask(func, info, args, kwargs):
    x = args[0]
    if is_nested(x):
        return generic(func, info, args, kwargs)  # refused there, as by any other op
    return _post(func, info, args, kwargs, _padded_key(x), expect=False)


def _encoder_layer(func, info, args, kwargs):
    if not is_nested(args[0]):
        return generic(func, info, args, kwargs)
    # the layer keeps the embedding size: its output pads to the input's shape
    return _post(func, info, args, kwargs, args[0]._r.key, expect=False)


def _to_padded(func, info, args, kwargs):
    x = args[0]
    if not is_nested(x):
        return generic(func, info, args, kwargs)
    size = args[2] if len(args) > 2 else kwargs.get("output_size")
    if size is None:  # the longest sequence decides the shape: the server says
        sess, dev, where = _route(func, args, kwargs)
        return run_dynamic(func, info, args, kwargs, sess, dev, where)
    shape = tuple(size)
    key = new_storage_key(x.dtype, shape, _contiguous(shape), 0)
    return _post(func, info, args, kwargs, key, expect=True)


HANDLERS = {
    aten._nested_tensor_from_mask.default: _from_mask,
    aten._transformer_encoder_layer_fwd.default: _encoder_layer,
    aten.to_padded_tensor.default: _to_padded,
}  # installed into plans.SPECIAL by rgpu._registration
