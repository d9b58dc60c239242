"""What the client learns about repeated op sequences: recorded segments, the templates made
from two alike recordings, and the slots they occupy on the server (rgpu.replay uses them).

An op is recorded as its *relative* form: the msgpack bytes of `(op, args, kwargs[, expect])`
with every tensor named by its place in the segment (`Slot`s: an output of an earlier op of the
segment, or the segment's n-th input) instead of by id, plus its outputs' id offsets. Two
segments whose ops have the same relative forms are the same computation on (possibly) other
inputs. Scalars may differ between them (AdamW's step sizes change every step; `x * lr` sends
`lr` as a 0-dim CPU tensor): `merge` finds the float64 items and inline 0-dim tensors whose value
differs and makes them the template's parameters, compared by the bytes around them from then on.
Everything else must be byte for byte the same.
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
_EXT_HEADER = {0xD4: 2, 0xD5: 2, 0xD6: 2, 0xD7: 2, 0xD8: 2, 0xC7: 3, 0xC8: 4, 0xC9: 6}


class OpRec:
    """One op as recorded: relative form, output offsets, inputs of the segment so far, and the
    scalars that vary (a template's parameters), as `scalar_items` gives them."""

    __slots__ = ("rel", "outs", "ninputs", "mask", "pieces")

    def __init__(self, rel: bytes, outs: tuple, ninputs: int, mask: tuple = ()) -> None:
        self.rel = rel
        self.outs = outs
        self.ninputs = ninputs
        self.mask = mask
        pieces = []
        start = 0
        for _, begin, end in mask:  # the bytes around varying values, their headers included
            pieces.append((start, rel[start:begin]))
            start = end
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

    def params(self, rel: bytes) -> list:
        """This op's varying values in `rel`: floats, and 0-dim CPU tensors as their ext."""
        return [
            _F64.unpack_from(rel, begin)[0]
            if rel[o] == _FLOAT64
            else msgpack.ExtType(EXT_HOST, rel[begin - 2 : end])
            for o, begin, end in self.mask
        ]

    def key(self) -> tuple:
        return (self.rel if not self.mask else self.pieces, self.outs, self.ninputs, self.mask)


def scalar_items(data: bytes) -> list[tuple[int, int, int]]:
    """(item offset, value start, value end) of each float64 and each inline 0-dim CPU tensor
    (EXT_HOST of ndim 0: its bytes after dtype and ndim) of a msgpack value, in order."""
    found = []
    i = 0
    todo = 1
    u16 = struct.Struct(">H").unpack_from
    u32 = struct.Struct(">I").unpack_from
    fixed = {0xC0: 1, 0xC2: 1, 0xC3: 1, 0xCA: 5, 0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9, 0xD0: 2,
             0xD1: 3, 0xD2: 5, 0xD3: 9}  # fmt: skip
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
            found.append((i, i + 1, i + 9))
            i += 9
        elif t in _EXT_HEADER:  # ext: fixext 1..16, ext 8, 16, 32
            head = _EXT_HEADER[t]
            if t >= 0xD4:
                n = 1 << (t - 0xD4)
            elif t == 0xC7:
                n = data[i + 1]
            else:
                n = (u16 if t == 0xC8 else u32)(data, i + 1)[0]
            start = i + head
            if data[start - 1] == EXT_HOST and n >= 2 and data[start + 1] == 0:
                found.append((i, start + 2, start + n))
            i = start + n
        elif t in fixed:
            i += fixed[t]
        elif t in (0xC4, 0xD9):  # bin 8, str 8
            i += 2 + data[i + 1]
        elif t in (0xC5, 0xDA):
            i += 3 + u16(data, i + 1)[0]
        elif t in (0xC6, 0xDB):
            i += 5 + u32(data, i + 1)[0]
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


def lookup_key(rel: bytes) -> bytes:
    """A segment's first op as a lookup key: its relative form with every scalar's value
    zeroed, so a first op whose scalars vary still finds its templates."""
    items = scalar_items(rel)
    if not items:
        return rel
    key = bytearray(rel)
    for _, begin, end in items:
        key[begin:end] = bytes(end - begin)
    return bytes(key)


def _merge_op(a: OpRec, b: OpRec) -> OpRec | None:
    """`b` with the scalars that differ from `a` (or varied before) as parameters; None when
    they differ in anything else."""
    if a.outs != b.outs or a.ninputs != b.ninputs:
        return None
    if a.rel == b.rel and a.mask == b.mask:
        return a
    if len(a.rel) != len(b.rel):
        return None
    varying = set(a.mask) | set(b.mask)
    start = 0
    for item in scalar_items(b.rel):
        _, begin, end = item
        if a.rel[start:begin] != b.rel[start:begin]:
            return None
        if item in varying or a.rel[begin:end] != b.rel[begin:end]:
            varying.add(item)
        start = end
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

    def __init__(self, slot: int, ops: list[OpRec], key: tuple = ()) -> None:
        self.slot = slot
        self.ops = ops
        self.key = key  # (device, lookup_key of its first op)
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
                for k, (o, _, end) in enumerate(op.mask):
                    parts += [data[start:o], msgpack.packb(slot_ext(SlotKind.PARAM, k))]
                    start = end
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
        # by (device, first op): a DEFINE names the current device as "rgpu", so a template
        # replays only on the device it was defined on
        self.groups: dict[tuple, list[Template]] = {}  # most recently used first
        # recordings waiting for a twin, by first op and length (segments that start alike)
        self.recent: collections.OrderedDict[tuple, list[OpRec]] = collections.OrderedDict()
        self.by_slot: collections.OrderedDict[int, Template] = collections.OrderedDict()  # LRU

    def candidates(self, rel: bytes, device: int = 0) -> list[Template] | None:
        """The templates a segment on `device` whose first op is `rel` may follow, most
        recently used first."""
        return self.groups.get((device, lookup_key(rel)))

    def used(self, t: Template) -> None:
        group = self.groups.get(t.key)
        if group and group[0] is not t and t in group:
            group.remove(t)
            group.insert(0, t)
        if t.slot in self.by_slot:
            self.by_slot.move_to_end(t.slot)

    def switch(self, t: Template, j: int) -> list[Template]:
        """Other templates of `t`'s group that share its first `j` ops and go on past them."""
        group = self.groups.get(t.key) or ()
        return [u for u in group if u is not t and t.cpl.get(u.slot, 0) >= j and len(u.ops) > j]

    def learn(self, rec: list[OpRec], device: int = 0) -> bool:
        """Take a finished segment's recording (its ops ran on `device`); True if it matched
        or made a template."""
        key = (device, lookup_key(rec[0].rel))
        group = self.groups.get(key, [])
        for t in group:
            merged = merge(t.ops, rec)
            if merged is not None:
                if any(m.mask != o.mask for m, o in zip(merged, t.ops)):
                    self._add(key, merged, replacing=t)  # more floats vary than it knew
                return True
        prev = self.recent.pop((key, len(rec)), None)
        merged = merge(prev, rec) if prev is not None else None
        if merged is not None:
            return self._add(key, merged)
        self.recent[key, len(rec)] = rec
        while len(self.recent) > RECENT:
            self.recent.popitem(last=False)
        return False

    def _add(self, key: tuple, ops: list[OpRec], replacing: Template | None = None) -> bool:
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
        t = Template(slot, ops, key)
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
        key = t.key
        group = self.groups.get(key, [])
        if t in group:
            group.remove(t)
        if not group:
            self.groups.pop(key, None)
        for u in group:
            u.cpl.pop(t.slot, None)
