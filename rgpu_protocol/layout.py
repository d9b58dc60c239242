"""Facts about strided layouts that the client and the server must compute the same way."""

from __future__ import annotations

from collections.abc import Sequence


def storage_span(shape: Sequence[int], stride: Sequence[int], offset: int) -> int:
    """Elements of storage a layout needs: up to and including its last element (just `offset`
    when it has no elements)."""
    if all(s > 0 for s in shape):
        return offset + sum((s - 1) * st for s, st in zip(shape, stride)) + 1
    return offset


def dense_strides(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """True when `stride` is a permutation of contiguous strides (no gaps, no overlap)."""
    if 0 in shape:
        return True
    dims = sorted((st, sz) for sz, st in zip(shape, stride) if sz != 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            return False
        expected *= sz
    return True
