"""Metadata keys: the hashable (dtype, shape, stride, storage_offset, storage_nbytes, flags) that
names a tensor's layout (flags bit 0: the conjugate bit, bit 1: the negative bit, bit 2: NESTED),
and the meta tensors they stand for. Re-exported by `rgpu.tensor`."""

from __future__ import annotations

from typing import Any

import torch

from rgpu_protocol import storage_span

Key = tuple

# The server holds a nested tensor and the key's shape is its padded one (rgpu.nested_ops): no
# meta tensor stands for it.
NESTED = 4


def is_dense_key(key: Key) -> bool:
    """True when `key` is what a fresh contiguous tensor of its shape and dtype has (strides,
    offset 0, exactly its bytes, no conj/neg bit): `wrap_dense` can then leave them implicit."""
    dtype, shape, stride, offset, nbytes, flags = key
    if offset or flags:
        return False
    try:
        m = torch.empty(shape, dtype=dtype, device="meta")
    except RuntimeError:  # a dtype the meta device refuses: the general wrapper will do
        return False
    return m.stride() == stride and m.untyped_storage().nbytes() == nbytes


def key_of_meta(m: torch.Tensor) -> Key:
    """The metadata key of a meta (or any) tensor."""
    flags = (1 if m.is_conj() else 0) | (2 if m.is_neg() else 0)
    return (
        m.dtype,
        tuple(m.shape),
        m.stride(),
        m.storage_offset(),
        m.untyped_storage().nbytes(),
        flags,
    )


def meta_of_key(key: Key) -> torch.Tensor:
    """A fresh meta tensor with exactly this layout, over a storage of the same byte size."""
    dtype, shape, stride, offset, nbytes, flags = key
    if flags & NESTED:
        raise nested_refused()
    storage = torch.empty(nbytes, dtype=torch.uint8, device="meta").untyped_storage()
    m = torch.empty(0, dtype=dtype, device="meta")
    m.set_(storage, offset, shape, stride)
    if flags & 1:
        torch._C._set_conj(m, True)
    if flags & 2:
        torch._C._set_neg(m, True)
    return m


def nested_refused() -> RuntimeError:
    return RuntimeError(
        "this rgpu tensor is a nested tensor, made by nn.TransformerEncoder's fast path (eval "
        "mode with a src_key_padding_mask); rgpu runs only that path's ops on nested tensors. "
        "Pad it first: t.to_padded_tensor(0.0, size)"
    )


def key_of_tensor_meta(m: Any) -> Key:
    """The metadata key of a tensor the server described (a TensorMeta)."""
    span = storage_span(m.shape, m.stride, m.offset) * m.dtype.itemsize
    return (m.dtype, tuple(m.shape), tuple(m.stride), m.offset, span,
            (1 if m.conj else 0) | (2 if m.neg else 0))  # fmt: skip


def new_storage_key(dtype: torch.dtype, shape: tuple, stride: tuple, offset: int) -> Key:
    """Key of a tensor that owns exactly the storage its layout spans."""
    span = storage_span(shape, stride, offset)
    return (dtype, tuple(shape), tuple(stride), offset, span * dtype.itemsize, 0)


def check_copy_fits(dst: Any, src: Any, where: str) -> None:
    """`dst.copy_(src)` broadcasts `src` to `dst`'s shape: refuse it as torch does when it can't."""
    try:
        fits = src.shape == dst.shape or torch.broadcast_shapes(src.shape, dst.shape) == dst.shape
    except RuntimeError:
        fits = False
    if not fits:
        raise RuntimeError(
            f"The size of tensor a ({list(dst.shape)}) must match the size of tensor b "
            f"({list(src.shape)}) for copy_ {where}"
        )
