"""Values of a defined sequence (Kind.DEFINE): tensors and scalars named by their place in a
run of the sequence, not by id, so one definition serves every repetition.

An `EXT_SLOT` stands for the output of an earlier op of the run (`OUT`: the tensor under id
`base + index`, where each REPLAY gives `base`), for one of the run's inputs (`INPUT`: REPLAY's
`inputs[index]`, numbered in order of first use), or for a scalar that changes from one
repetition to the next (`PARAM`: the op's `index`-th value in REPLAY's `params`). An
`EXT_SLOT_VIEW` is a view of an `OUT` or `INPUT` slot, as `EXT_VIEW` is of an id.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import msgpack

from .errors import ProtocolError

EXT_SLOT = 11  # u8 slot kind, u32 index
EXT_SLOT_VIEW = 12  # u8 slot kind, u32 index, u8 ndim, i64 shape[ndim], stride[ndim], offset
MAX_NDIM = 64


class SlotKind:
    OUT = 0  # the tensor under id `base + index`
    INPUT = 1  # the run's input `index`
    PARAM = 2  # the op's varying scalar `index`


@dataclass(frozen=True, slots=True)
class Slot:
    kind: int
    index: int


@dataclass(frozen=True, slots=True)
class SlotView:
    """`slot.as_strided(shape, stride, offset)`."""

    kind: int
    index: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


_SLOT = struct.Struct("<BI")


def _ext(code: int, data: bytes) -> msgpack.ExtType:
    return tuple.__new__(msgpack.ExtType, (code, data))  # known-good arguments: skip the checks


def slot_ext(kind: int, index: int) -> msgpack.ExtType:
    return _ext(EXT_SLOT, _SLOT.pack(kind, index))


def slot_view_ext(kind: int, index: int, layout: bytes) -> msgpack.ExtType:
    """A view of a slot; `layout` is an `EXT_VIEW` payload after its base id (u8 ndim, then i64
    shape, stride and offset), which is how the client already holds a lazy view's layout."""
    return _ext(EXT_SLOT_VIEW, _SLOT.pack(kind, index) + layout)


def encode_slot(value: Slot | SlotView) -> msgpack.ExtType:
    if type(value) is Slot:
        return slot_ext(value.kind, value.index)
    n = len(value.shape)
    layout = struct.pack(f"<B{2 * n + 1}q", n, *value.shape, *value.stride, value.offset)
    return slot_view_ext(value.kind, value.index, layout)


def decode_slot(code: int, data: bytes) -> Slot | SlotView:
    if len(data) < 5:
        raise ProtocolError("sequence slot is truncated")
    kind, index = _SLOT.unpack_from(data)
    if kind > SlotKind.PARAM or (code == EXT_SLOT_VIEW and kind == SlotKind.PARAM):
        raise ProtocolError(f"unknown sequence slot kind {kind}")
    if code == EXT_SLOT:
        if len(data) != 5:
            raise ProtocolError("sequence slot must be 5 bytes")
        return Slot(kind, index)
    n = data[5] if len(data) > 5 else -1
    if n < 0 or n > MAX_NDIM or len(data) != 6 + 8 * (2 * n + 1):
        raise ProtocolError("sequence slot view has the wrong length")
    vals = struct.unpack_from(f"<{2 * n + 1}q", data, 6)
    if any(s < 0 for s in vals[:n]) or vals[2 * n] < 0:
        raise ProtocolError("sequence slot view has a negative size or offset")
    return SlotView(kind, index, vals[:n], vals[n : 2 * n], vals[2 * n])
