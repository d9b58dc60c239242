"""An in-place op whose input shares memory with the tensor it writes: asked of the server.

CPU and CUDA kernels refuse to write into memory another argument reads from (PyTorch's
`assert_no_partial_overlap` / `assert_no_overlap`: `x[1:].add_(x[:-1])`, `x.index_add_(0, i,
x[:3])`) before writing anything. Sent like any op, the refusal came at a later wait and the
tensor the op would have written was poisoned. Such a call now runs synchronously (RUN_DYN): the
server's kernel decides, its refusal is raised at the op and the tensor keeps its values, and
what the kernel accepts runs as before.

Which pairs to look at is decided once per plan, from layouts only, as PyTorch's
`get_overlap_status` does: both tensors dense and non-overlapping (otherwise PyTorch cannot tell
either and checks nothing: `boxes[:, 2].sub_(boxes[:, 0])` stays asynchronous), and their byte
ranges intersecting. A call then only compares the two tensors' storages.
"""

from __future__ import annotations

from . import storage_ids as _storage_ids
from .strides import _non_overlapping_and_dense
from .tensor import RemoteTensor


def _span(key: tuple) -> tuple[int, int] | None:
    """The bytes of its storage a dense, non-overlapping tensor covers; None when PyTorch's
    overlap check cannot tell (not dense) or there is nothing (no elements)."""
    dtype, shape, stride, offset = key[0], key[1], key[2], key[3]
    numel = 1
    for n in shape:
        numel *= n
    if numel == 0 or not _non_overlapping_and_dense(tuple(shape), tuple(stride)):
        return None
    start = offset * dtype.itemsize
    return start, start + numel * dtype.itemsize


def pairs_to_check(write_rets: tuple, args: tuple, kwargs: dict) -> tuple | None:
    """((written position, read position), ...) whose layouts can overlap, or None."""
    found = []
    named = list(enumerate(args)) + list(kwargs.items())
    for _, pos, name in write_rets:
        where = pos if 0 <= pos < len(args) else name
        w = args[pos] if 0 <= pos < len(args) else kwargs.get(name)
        if type(w) is not RemoteTensor:
            continue
        ws = _span(w._r.key)
        if ws is None:
            continue
        for other, a in named:
            if type(a) is RemoteTensor and other != where:
                span = _span(a._r.key)
                if span is not None and span[0] < ws[1] and ws[0] < span[1]:
                    found.append((where, other))
    return tuple(found) or None


def overlap(pairs: tuple, args: tuple, kwargs: dict) -> bool:
    """True when a written tensor and a read one of this call share memory (not the same
    tensor: `x.mul_(x)` is fine everywhere)."""
    aliases = _storage_ids._alias_of  # server-made views of another dtype (rarely any)
    for where, other in pairs:
        w = args[where] if type(where) is int else kwargs[where]
        a = args[other] if type(other) is int else kwargs[other]
        if w is a:
            continue
        hw, ha = w._r, a._r
        bw, ba = hw.base or hw, ha.base or ha
        if bw is ba or (aliases and aliases.get(bw, bw) is aliases.get(ba, ba)):
            return True
    return False
