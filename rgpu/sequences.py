"""What the client learns about repeated op sequences: recorded segments, the templates made
from two alike recordings, and the slots they occupy on the server (rgpu.replay uses them).

An op is recorded as its *relative* form: the msgpack bytes of `(op, args, kwargs[, expect])`
with every tensor named by its place in the segment (`Slot`s: an output of an earlier op of the
segment, or the segment's n-th input) instead of by id, plus its outputs' id offsets. Two
segments whose ops have the same relative forms are the same computation on (possibly) other
inputs. Floats may differ between them (AdamW's step sizes change every step): `merge` finds the
float64 items whose value differs and makes them the template's parameters, compared by the
bytes around them from then on. Everything else must be byte for byte the same.
"""

from __future__ import annotations

import collections
import struct
from typing import Any

import msgpack

from rgpu_protocol import (
    EXT_HOST,
    EXT_SLOT,
    EXT_SLOT_VIEW,
    MAX_SEQUENCE_OPS,
    MAX_SEQUENCE_TOTAL_OPS,
    MAX_SEQUENCES,
    Kind,
    SlotKind,
    slot_ext,
)

MIN_OPS = 8  # shorter segments are sent as they are: a replay would save little
GROUP = 4  # templates kept per first op (a training step and an evaluation step, say)
RECENT = 16  # recordings kept, waiting for a second alike one
_F64 = struct.Struct(">d")
_FLOAT64 = 0xCB  # msgpack's float 64 marker: the byte, then 8 bytes big-endian


class OpRec:
    """One op as recorded: relative form, output offsets, inputs of the segment so far, and the
    byte offsets of float64 items that vary (a template's parameters)."""

    __slots__ = ("rel", "outs", "ninputs", "mask", "pieces")

    def __init__(self, rel: bytes, outs: tuple, ninputs: int, mask: tuple = ()) -> None:
        self.rel = rel
        self.outs = outs
        self.ninputs = ninputs
        self.mask = mask
        pieces = []
        start = 0
        for o in mask:  # the bytes between varying floats, marker bytes included
            pieces.append((start, rel[start : o + 1]))
            start = o + 9
        pieces.append((start, rel[start:]))
        self.pieces = tuple(pieces)

    def same(self, rel: bytes) -> bool:
        """`rel` is this op, its varying floats aside."""
        if len(rel) != len(self.rel):
            return False
        for start, piece in self.pieces:
            if not rel.startswith(piece, start):
                return False
        return True

    def params(self, rel: bytes) -> list[float]:
        return [_F64.unpack_from(rel, o + 1)[0] for o in self.mask]

    def key(self) -> tuple:
        return (self.rel if not self.mask else self.pieces, self.outs, self.ninputs, self.mask)


def float_offsets(data: bytes) -> list[int]:
    """Offsets of the float64 items of a msgpack value, in order (a small msgpack walker)."""
    found = []
    i = 0
    todo = 1
    u16 = struct.Struct(">H").unpack_from
    u32 = struct.Struct(">I").unpack_from
    fixed = {0xC0: 1, 0xC2: 1, 0xC3: 1, 0xCA: 5, 0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9, 0xD0: 2,
             0xD1: 3, 0xD2: 5, 0xD3: 9, 0xD4: 3, 0xD5: 4, 0xD6: 6, 0xD7: 10, 0xD8: 18}  # fmt: skip
    while todo:
        todo -= 1
        t = data[i]
        if t <= 0x7F or t >= 0xE0:
            i += 1
        elif t <= 0x8F:
            todo += 2 * (t & 0x0F)
            i += 1
        elif t <= 0x9F:
            todo += t & 0x0F
            i += 1
        elif t <= 0xBF:
            i += 1 + (t & 0x1F)
        elif t == _FLOAT64:
            found.append(i)
            i += 9
        elif t in fixed:
            i += fixed[t]
        elif t in (0xC4, 0xD9):  # bin 8, str 8
            i += 2 + data[i + 1]
        elif t in (0xC5, 0xDA):
            i += 3 + u16(data, i + 1)[0]
        elif t in (0xC6, 0xDB):
            i += 5 + u32(data, i + 1)[0]
        elif t == 0xC7:  # ext 8, 16, 32
            i += 3 + data[i + 1]
        elif t == 0xC8:
            i += 4 + u16(data, i + 1)[0]
        elif t == 0xC9:
            i += 6 + u32(data, i + 1)[0]
        elif t == 0xDC:  # array 16, 32; map 16, 32
            todo += u16(data, i + 1)[0]
            i += 3
        elif t == 0xDD:
            todo += u32(data, i + 1)[0]
            i += 5
        elif t == 0xDE:
            todo += 2 * u16(data, i + 1)[0]
            i += 3
        elif t == 0xDF:
            todo += 2 * u32(data, i + 1)[0]
            i += 5
        else:
            raise ValueError(f"not msgpack: byte {t:#x} at {i}")
    return found


def _merge_op(a: OpRec, b: OpRec) -> OpRec | None:
    """`b` with the floats that differ from `a` (or varied before) as parameters; None when
    they differ in anything else."""
    if a.outs != b.outs or a.ninputs != b.ninputs:
        return None
    if a.rel == b.rel and a.mask == b.mask:
        return a
    if len(a.rel) != len(b.rel):
        return None
    varying = set(a.mask) | set(b.mask)
    start = 0
    for o in float_offsets(b.rel):
        if a.rel[start : o + 1] != b.rel[start : o + 1]:
            return None
        if o in varying or a.rel[o + 1 : o + 9] != b.rel[o + 1 : o + 9]:
            varying.add(o)
        start = o + 9
    if a.rel[start:] != b.rel[start:]:
        return None
    return OpRec(b.rel, b.outs, b.ninputs, tuple(sorted(varying)))


def merge(a: list[OpRec], b: list[OpRec]) -> list[OpRec] | None:
    """One template for two alike recordings, or None."""
    if len(a) != len(b):
        return None
    merged = []
    for x, y in zip(a, b):
        m = _merge_op(x, y)
        if m is None:
            return None
        merged.append(m)
    return merged


def _depth_ok(value: Any, depth: int) -> bool:
    """Slots and inline tensors at most two deep in args or kwargs (the server's limit):
    `args[i]` is at depth 1, `args[i][k]` at depth 2."""
    if type(value) is msgpack.ExtType:
        return depth <= 2 or value.code not in (EXT_SLOT, EXT_SLOT_VIEW, EXT_HOST)
    if type(value) is list:
        return all(_depth_ok(v, depth + 1) for v in value)
    if type(value) is dict:
        return all(_depth_ok(v, depth + 1) for v in value.values())
    return True


class Template:
    """A learned sequence: its ops, its slot on the server, whether the server has it yet."""

    def __init__(self, slot: int, ops: list[OpRec]) -> None:
        self.slot = slot
        self.ops = ops
        self.defined = False  # DEFINE is sent before its first REPLAY
        self.cpl: dict[int, int] = {}  # slot of another template of the group -> shared ops

    def define_message(self) -> tuple | None:
        """The DEFINE that carries it, varying floats as PARAM slots (None: not sendable)."""
        ops = []
        for op in self.ops:
            data = op.rel
            if op.mask:
                parts = []
                start = 0
                for k, o in enumerate(op.mask):
                    parts += [data[start:o], msgpack.packb(slot_ext(SlotKind.PARAM, k))]
                    start = o + 9
                data = b"".join(parts) + data[start:]
            fields = msgpack.unpackb(data, raw=False, strict_map_key=False)
            if not all(_depth_ok(v, 0) for v in (fields[1], fields[2])):
                return None
            expect = fields[3] if len(fields) > 3 else None
            ops.append([fields[0], fields[1], fields[2], list(op.outs), expect])
        return (Kind.DEFINE, self.slot, ops)


def common_prefix(a: list[OpRec], b: list[OpRec]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x.key() != y.key():
            break
        n += 1
    return n


class Library:
    """Templates by their first op's relative form, the recordings waiting for a twin, and the
    server's sequence slots (at most MAX_SEQUENCES, MAX_SEQUENCE_TOTAL_OPS ops in all)."""

    def __init__(self, max_define_bytes: int) -> None:
        self.max_define_bytes = max_define_bytes
        self.groups: dict[bytes, list[Template]] = {}  # most recently used first
        self.recent: collections.OrderedDict[bytes, list[OpRec]] = collections.OrderedDict()
        self.by_slot: collections.OrderedDict[int, Template] = collections.OrderedDict()  # LRU

    def candidates(self, key: bytes) -> list[Template] | None:
        return self.groups.get(key)

    def used(self, t: Template) -> None:
        group = self.groups.get(t.ops[0].rel)
        if group and group[0] is not t and t in group:
            group.remove(t)
            group.insert(0, t)
        if t.slot in self.by_slot:
            self.by_slot.move_to_end(t.slot)

    def switch(self, t: Template, j: int) -> list[Template]:
        """Other templates of `t`'s group that share its first `j` ops and go on past them."""
        group = self.groups.get(t.ops[0].rel) or ()
        return [u for u in group if u is not t and t.cpl.get(u.slot, 0) >= j and len(u.ops) > j]

    def learn(self, rec: list[OpRec]) -> bool:
        """Take a finished segment's recording; True if it matched or made a template."""
        key = rec[0].rel
        group = self.groups.get(key, [])
        for t in group:
            merged = merge(t.ops, rec)
            if merged is not None:
                if any(m.mask != o.mask for m, o in zip(merged, t.ops)):
                    self._add(key, merged, replacing=t)  # more floats vary than it knew
                return True
        prev = self.recent.pop(key, None)
        merged = merge(prev, rec) if prev is not None else None
        if merged is not None and not merged[0].mask:  # the first op is the lookup key
            return self._add(key, merged)
        self.recent[key] = rec
        while len(self.recent) > RECENT:
            self.recent.popitem(last=False)
        return False

    def _add(self, key: bytes, ops: list[OpRec], replacing: Template | None = None) -> bool:
        if len(ops) > MAX_SEQUENCE_OPS:
            return False
        group = self.groups.get(key, [])
        if replacing is not None:
            self._drop(replacing)
        elif len(group) >= GROUP:
            self._drop(group[-1])
        while self.by_slot and (
            len(self.by_slot) >= MAX_SEQUENCES
            or sum(len(t.ops) for t in self.by_slot.values()) + len(ops) > MAX_SEQUENCE_TOTAL_OPS
        ):
            self._drop(next(iter(self.by_slot.values())))
        slot = replacing.slot if replacing is not None else min(
            set(range(MAX_SEQUENCES)) - set(self.by_slot)
        )  # fmt: skip
        t = Template(slot, ops)
        define = t.define_message()
        if define is None or len(msgpack.packb(define)) > self.max_define_bytes:
            return False
        group = self.groups.setdefault(key, [])
        for u in group:
            u.cpl[slot] = t.cpl[u.slot] = common_prefix(u.ops, ops)
        group.insert(0, t)
        self.by_slot[slot] = t
        return True

    def _drop(self, t: Template) -> None:
        self.by_slot.pop(t.slot, None)
        key = t.ops[0].rel
        group = self.groups.get(key, [])
        if t in group:
            group.remove(t)
        if not group:
            self.groups.pop(key, None)
        for u in group:
            u.cpl.pop(t.slot, None)
