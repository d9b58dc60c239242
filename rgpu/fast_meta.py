"""Outputs of a few hot ops worked out directly instead of by PyTorch's Python meta kernels.

Why: generation misses the plan cache on every token (the KV cache grows; a slice of the growing
ids has new strides), and the Python reference kernels behind `cat` and pointwise arithmetic on
meta tensors take 0.4-0.9 ms a call on this machine, a tenth of a small model's decode step. The
rules here are the kernels' own: TensorIterator's layout (`strides.tensor_iterator_strides`,
which the slow path applies too) and `cat`'s output memory format. Anything off the plain path
(mixed dtypes, Python numbers, `alpha`, empty inputs, channels-last cats) returns None and goes
the slow way, which also raises the op's own errors.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._prims_common import suggest_memory_format

from .strides import tensor_iterator_strides

aten = torch.ops.aten
_META = torch.device("meta")
_ARITHMETIC = {aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor}


def _plain(t: Any) -> bool:
    return (
        type(t) is torch.Tensor
        and t.device == _META
        and t.layout == torch.strided
        and not t.is_conj()
        and not t.is_neg()
    )


def _broadcast(a: tuple, b: tuple) -> tuple | None:
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + a, (1,) * (n - len(b)) + b
    out = []
    for x, y in zip(a, b):
        if x == y or y == 1:
            out.append(x)
        elif x == 1:
            out.append(y)
        else:
            return None  # the slow path raises the op's own error
    return tuple(out)


def _arithmetic(args: tuple, kwargs: dict) -> torch.Tensor | None:
    if kwargs or len(args) != 2:
        return None
    a, b = args
    if not (_plain(a) and _plain(b)) or a.dtype != b.dtype or a.dtype == torch.bool:
        return None
    shape = _broadcast(tuple(a.shape), tuple(b.shape))
    if shape is None:
        return None
    strides = tensor_iterator_strides(
        [(tuple(a.shape), a.stride()), (tuple(b.shape), b.stride())], shape
    )
    if strides is None:
        return None
    return torch.empty_strided(shape, strides, dtype=a.dtype, device=_META)


def _cat(args: tuple, kwargs: dict) -> torch.Tensor | None:
    if kwargs or not args or len(args) > 2:
        return None
    tensors = args[0]
    dim = args[1] if len(args) == 2 else 0
    if type(tensors) not in (list, tuple) or not tensors or type(dim) is not int:
        return None
    first = tensors[0]
    if not _plain(first) or first.dim() == 0:
        return None
    ndim, dtype = first.dim(), first.dtype
    if not -ndim <= dim < ndim:
        return None
    dim %= ndim
    shape = list(first.shape)
    total = 0
    for t in tensors:
        if not _plain(t) or t.dtype != dtype or t.dim() != ndim or t.numel() == 0:
            return None
        for d in range(ndim):
            if d != dim and t.shape[d] != shape[d]:
                return None
        total += t.shape[dim]
    shape[dim] = total
    if ndim in (4, 5):
        # cat's output format: channels-last only when every input suggests it
        if all(suggest_memory_format(t) != torch.contiguous_format for t in tensors):
            return None
    return torch.empty(shape, dtype=dtype, device=_META)


def run(func: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The op's output on meta tensors, or None where the slow path must decide."""
    if func in _ARITHMETIC:
        return _arithmetic(args, kwargs)
    if func is aten.cat.default:
        return _cat(args, kwargs)
    return None
