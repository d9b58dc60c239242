"""Replayed sequences: DEFINE keeps a client's repeated op sequence resolved; REPLAY runs a
stretch of it with one message.

Why: a training step repeats the same few hundred ops every time. Sent as RUNs, each costs the
server a decode, a spec check, a name lookup and ext hooks per tensor; a REPLAY names the
sequence, its run's inputs and the scalars that change (AdamW's step sizes), and the ops run here
in a tight loop from arguments prepared at DEFINE.

Semantics are the RUNs' own, op by op: every op that is not plain (poisoned or missing inputs,
seeded ops, a quota, expected layouts, refused names) goes through `execute.run` with the
message its RUN would have been, and the fast path repeats `execute.run`'s hot path (stretches
of such ops run as generated straight-line code: rgpu_server.replay_compiled). A failure
inside a REPLAY poisons what the RUN would have poisoned; its Poison also carries the op's index
in the REPLAY (`SessionState.replay_index`), so the client can name the line that queued it. A
CANCEL reaching the REPLAY while it runs cancels its remaining ops, as it would their RUNs.

CUDA graph capture of a sequence is not built: it needs static input and output addresses
(outputs would live in the graph's pool and be overwritten by the next replay, so every output a
client keeps would need a copy), no host syncs inside, and per-op failure semantics that a graph
cannot give; docs/architecture.md, "Replayed steps", says what it would take.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from rgpu_protocol import (
    MAX_SEQUENCE_OPS,
    MAX_SEQUENCE_TOTAL_OPS,
    MAX_SEQUENCES,
    SPECS,
    Kind,
    ProtocolError,
    Slot,
    SlotKind,
    SlotView,
)

from .bindings import for_slots
from .execute import cancel as cancel_message
from .execute import run, store
from .ops import OpRefused, resolve
from .poison import Poison, describe
from .replay_compiled import cached as _compiled
from .replay_compiled import forget as _forget_compiled
from .state import SessionState

_OUT, _INPUT, _PARAM = SlotKind.OUT, SlotKind.INPUT, SlotKind.PARAM
_CONST = 3  # a CPU tensor the definition carries: a fresh copy every run, as decoding makes one
_RUN = int(Kind.RUN)
_RUN_SPEC = SPECS[Kind.RUN]
_NO_EXPECT = (None,) * 5  # what `store` reads when an op has no expected layouts
# stretches of plain ops run as generated straight-line functions (replay_compiled);
# RGPU_REPLAY_COMPILED=0 runs every op through the loop
COMPILED = os.environ.get("RGPU_REPLAY_COMPILED", "1") != "0"


class SeqOp:
    """One op of a sequence, prepared: its resolved operator and where the run's values go."""

    __slots__ = ("name", "resolved", "args", "kwargs", "fills", "copies", "outs", "expect",
                 "nparams", "ninputs", "fast", "single", "simple", "one_tensor", "call")  # fmt: skip

    def __init__(self, raw: Any) -> None:
        if type(raw) is not list or len(raw) != 5:
            raise ProtocolError("a DEFINE op is [op, args, kwargs, out offsets, expect]")
        name, args, kwargs, outs, expect = raw
        if type(args) is not list or type(kwargs) not in (dict, type(None)):
            raise ProtocolError("a DEFINE op's args must be an array and its kwargs a map or nil")
        if type(outs) is not list or any(type(o) not in (int, type(None)) for o in outs):
            raise ProtocolError("a DEFINE op's out offsets must be integers or nil")
        if any(type(o) is int and o < 0 for o in outs):
            raise ProtocolError("a DEFINE op's out offsets must not be negative")
        if type(expect) not in (list, type(None)):
            raise ProtocolError("a DEFINE op's expected layouts must be an array or nil")
        self.name = name
        try:
            self.resolved = resolve(name)
        except OpRefused:
            self.resolved = None  # refused when it runs, as its RUN would be
        self.args = args
        self.kwargs = kwargs
        self.outs = tuple(outs)
        self.expect = expect
        self.fills: list[tuple] = []  # (0: args / 1: kwargs, key, inner index or -1, kind, ...)
        self.copies: list[tuple] = []  # lists inside args or kwargs that get filled
        params: list[int] = []
        self.ninputs = 0  # inputs of the run this op needs: 1 + its highest INPUT index
        for where, items in ((0, enumerate(args)), (1, (kwargs or {}).items())):
            for key, value in items:
                if self._fill(where, key, -1, value, params):
                    continue
                if type(value) is list:
                    inner = [self._fill(where, key, k, v, params) for k, v in enumerate(value)]
                    if any(inner):
                        self.copies.append((where, key))
                    if any(_holds_slot(v) for v in value if type(v) in (list, dict)):
                        raise ProtocolError("a DEFINE op's slots nest at most two deep")
                elif type(value) is dict and _holds_slot(value):
                    raise ProtocolError("a DEFINE op's slots nest at most two deep")
        if sorted(params) != list(range(len(params))):
            raise ProtocolError("a DEFINE op's PARAM slots must be numbered 0, 1, ... once each")
        self.nparams = len(params)
        r = self.resolved
        self.fast = r is not None and r.plain and expect is None
        self.single = len(outs) == 1 and outs[0] is not None
        self.one_tensor = True  # False once its one output came back as something else
        # the common op: plain, tensors by id straight in args (no views, lists or scalars)
        self.simple = None
        if self.fast and all(f[0] == 0 and f[2] < 0 and f[3] <= _INPUT and f[5] is None
                             for f in self.fills):  # fmt: skip
            self.simple = tuple((f[1], f[3], f[4]) for f in self.fills)
        self.call = None if self.simple is None else for_slots(r, args, kwargs, self.simple)

    def _fill(self, where: int, key: Any, k: int, value: Any, params: list) -> bool:
        t = type(value)
        if t is Slot or t is SlotView:
            view = None if t is Slot else (value.shape, value.stride, value.offset)
            if value.kind == _PARAM:
                params.append(value.index)
            elif value.kind == _INPUT:
                self.ninputs = max(self.ninputs, value.index + 1)
            self.fills.append((where, key, k, value.kind, value.index, view))
            return True
        if isinstance(value, torch.Tensor):  # inline CPU data (a server tensor is refused before)
            self.fills.append((where, key, k, _CONST, value, None))
            return True
        return False


def _holds_slot(value: Any) -> bool:
    if type(value) in (Slot, SlotView) or isinstance(value, torch.Tensor):
        return True
    if type(value) is list:
        return any(_holds_slot(v) for v in value)
    if type(value) is dict:
        return any(_holds_slot(v) for v in value.values())
    return False


class Sequence:
    """A DEFINE'd sequence: its ops, and how many run inputs and params precede each op."""

    __slots__ = ("ops", "inputs_at", "params_at", "compiled", "stretch_ends")

    def __init__(self, raw_ops: list) -> None:
        if not raw_ops or len(raw_ops) > MAX_SEQUENCE_OPS:
            raise ProtocolError(f"a DEFINE holds 1 to {MAX_SEQUENCE_OPS} ops")
        self.ops = [SeqOp(raw) for raw in raw_ops]
        self.compiled: dict = {}  # (start, end) -> its stretch's function: replay_compiled
        self.stretch_ends: list[int] = []  # per op: where the stretch from it ends
        self.inputs_at = [0]
        self.params_at = [0]
        for op in self.ops:
            self.inputs_at.append(max(self.inputs_at[-1], op.ninputs))
            self.params_at.append(self.params_at[-1] + op.nparams)


def define(s: SessionState, seq: int, msg: list) -> None:
    _, slot, raw_ops = msg
    if not 0 <= slot < MAX_SEQUENCES:
        raise ProtocolError(f"DEFINE slot must be 0 to {MAX_SEQUENCES - 1}, not {slot}")
    if s.refs or s.bad is not None:
        raise ProtocolError("a DEFINE names tensors by slot, never by id")
    sequence = Sequence(raw_ops)
    held = sum(len(q.ops) for k, q in s.sequences.items() if k != slot)
    if held + len(sequence.ops) > MAX_SEQUENCE_TOTAL_OPS:
        raise ProtocolError(
            f"a session's sequences hold at most {MAX_SEQUENCE_TOTAL_OPS} ops together"
        )
    s.sequences[slot] = sequence


def _continue_run(s: SessionState, seq: int, msg: list) -> tuple[Sequence, list]:
    """The REPLAY's sequence and its run's inputs so far (checked against the sequence)."""
    _, slot, start, stop, _base, inputs, params = msg
    sequence = s.sequences.get(slot)
    if sequence is None:
        raise ProtocolError(f"REPLAY of slot {slot}, which holds no sequence")
    if not 0 <= start < stop <= len(sequence.ops):
        raise ProtocolError(f"REPLAY of ops {start} to {stop} of a {len(sequence.ops)}-op sequence")
    if any(type(i) is not int for i in inputs):
        raise ProtocolError("REPLAY inputs must be tensor ids")
    if start == 0:
        run_state = s.sequence_run = [list(inputs), stop]
    else:
        run_state = s.sequence_run
        if run_state is None or run_state[1] != start:
            raise ProtocolError(f"REPLAY from op {start} continues no run that stopped there")
        run_state[0].extend(inputs)
        run_state[1] = stop
    if len(run_state[0]) != sequence.inputs_at[stop]:
        raise ProtocolError(f"REPLAY up to op {stop} needs {sequence.inputs_at[stop]} inputs")
    if len(params) != sequence.params_at[stop] - sequence.params_at[start]:
        raise ProtocolError("REPLAY carries the wrong number of params for its ops")
    return sequence, run_state[0]


def _build(s: SessionState, op: SeqOp, base: int, inputs: list, params: list, p: int) -> tuple:
    """(args, kwargs, first missing id or Poison, [(tensor, id)]): what decoding the op's RUN
    would have produced, and the references `written_ids` needs."""
    args = op.args.copy() if op.fills else op.args
    kwargs = op.kwargs
    if kwargs and op.fills:
        kwargs = dict(kwargs)
    for where, key in op.copies:
        target = args if where == 0 else kwargs
        target[key] = target[key].copy()
    bad = None
    made = []
    views: dict = {}
    tensors = s.tensors
    for where, key, k, kind, index, view in op.fills:
        if kind <= _INPUT:
            tid = base + index if kind == _OUT else inputs[index]
            value = tensors.get(tid)
            if value is None or type(value) is Poison:
                if bad is None:
                    bad = tid if value is None else value
                value = None
            else:
                if view is not None and (tid, view) in views:  # one view named twice: one
                    value = views[tid, view]  # tensor, as the client's (kernels test is_same)
                elif view is not None:
                    try:
                        value = views[tid, view] = value.as_strided(*view)
                    except RuntimeError as e:
                        value = None
                        if bad is None:
                            bad = Poison("view", f"invalid view of tensor {tid}: {e}",
                                         s.current_seq, s.replay_index)  # fmt: skip
                            if s.first_error is None:
                                s.first_error = tuple(bad.reply())
                if value is not None:
                    made.append((value, tid))
        elif kind == _PARAM:
            value = params[p + index]
        else:
            value = index.clone()
        target = args if where == 0 else kwargs
        if k < 0:
            target[key] = value
        else:
            target[key][k] = value
    return args, kwargs, bad, made


def _outs(op: SeqOp, base: int) -> list:
    return [None if o is None else base + o for o in op.outs]


def _message(op: SeqOp, args: list, kwargs: Any, outs: list) -> list:
    """The RUN this op stands for."""
    kw = dict(kwargs) if kwargs else kwargs  # `execute.call` may add a generator to it
    if op.expect is None:
        return [_RUN, op.name, args, kw, outs]
    return [_RUN, op.name, args, kw, outs, op.expect]


def replay(s: SessionState, seq: int, msg: list) -> None:
    sequence, inputs = _continue_run(s, seq, msg)
    _, _, start, stop, base, _, params = msg
    ops = sequence.ops
    tensors = s.tensors
    stream = s.stream
    plain = s.quota is None
    p = 0
    compiled = COMPILED and plain
    j = start
    try:
        while j < stop:
            if compiled:
                fn, end = _compiled(sequence, j, stop)
                if fn is not None:
                    j += _run_compiled(s, seq, sequence, fn, j, start, base, inputs)
                    # stopped short (a missing or poisoned input, an interrupt, a failed op):
                    # the loop takes the rest of this REPLAY, as it would have
                    compiled = j == end
                    continue
            if stream.cancel_upto >= seq:  # an interrupt: the ops not started are cancelled
                _cancel_ops(s, seq, ops[j:stop], base, inputs, params, p)
                return
            op = ops[j]
            s.replay_index = j - start
            j += 1
            simple = op.simple
            if simple is not None and plain:  # the hot path, as execute.run's
                args = op.args.copy()
                for pos, kind, index in simple:
                    t = tensors.get(base + index if kind == _OUT else inputs[index])
                    if t is None or type(t) is Poison:
                        break
                    args[pos] = t
                else:
                    resolved = op.resolved
                    kwargs = op.kwargs
                    try:
                        result = op.call(*args, **kwargs) if kwargs else op.call(*args)
                    except Exception as e:
                        _fail_simple(s, op, base, inputs, args, e)
                        continue
                    s.ops_run += 1
                    if op.single and type(result) is torch.Tensor:
                        tensors[base + op.outs[0]] = result
                    else:
                        store(s, resolved, _NO_EXPECT, _outs(op, base), result)
                    continue
            args, kwargs, bad, made = _build(s, op, base, inputs, params, p)
            p += op.nparams
            outs = _outs(op, base)
            if bad is None and op.fast and plain:
                resolved = op.resolved
                try:
                    result = resolved.call(*args, **kwargs) if kwargs else resolved.call(*args)
                except Exception as e:
                    s.refs = {id(t): tid for t, tid in made}
                    written = s.written_ids(resolved, args, kwargs)
                    s.refs = {}
                    s.fail(resolved.label, describe(e), [*outs, *written])
                    continue
                s.ops_run += 1
                if op.single and type(result) is torch.Tensor:
                    tensors[outs[0]] = result
                else:
                    store(s, resolved, _NO_EXPECT, outs, result)
            else:  # everything else exactly as its RUN
                s.bad = bad
                s.refs = {id(t): tid for t, tid in made}
                try:
                    run(s, seq, _message(op, args, kwargs, outs))
                finally:
                    s.bad = None
                    s.refs = {}
    finally:
        s.replay_index = None


def _fail_simple(
    s: SessionState, op: SeqOp, base: int, inputs: list, args: list, e: Exception
) -> None:
    """A simple op raised: poison its outputs and the tensors it writes, as its RUN would."""
    resolved = op.resolved
    s.refs = {id(args[pos]): base + i if k == _OUT else inputs[i]
              for pos, k, i in op.simple}  # fmt: skip
    written = s.written_ids(resolved, args, op.kwargs)
    s.refs = {}
    s.fail(resolved.label, describe(e), [*_outs(op, base), *written])


def _run_compiled(
    s: SessionState, seq: int, sequence: Sequence, fn: Any, j: int, start: int, base: int,
    inputs: list,
) -> int:  # fmt: skip
    """Run ops from `j` with their compiled stretch; how many it took (0: op j needs the loop).
    An op that raised is failed here as the loop fails it, and counts as taken."""
    tensors = s.tensors
    ops = sequence.ops

    def keep(k: int, result: Any) -> None:  # an output that is not one plain tensor
        op = ops[k]
        store(s, op.resolved, _NO_EXPECT, _outs(op, base), result)
        op.one_tensor = False  # later stretches end before it
        _forget_compiled(sequence)

    done, exc = fn(tensors, base, inputs, s.stream, seq, keep)
    s.ops_run += done
    if exc is None:
        return done
    op = ops[j + done]
    s.replay_index = j + done - start
    args = op.args.copy()
    for pos, kind, index in op.simple:
        args[pos] = tensors[base + index if kind == _OUT else inputs[index]]
    _fail_simple(s, op, base, inputs, args, exc)
    return done + 1


def _cancel_ops(
    s: SessionState, seq: int, ops: list, base: int, inputs: list, params: list, p: int
) -> None:
    """Poison these ops' new outputs as cancelled, as their RUNs would be."""
    for op in ops:
        args, kwargs, bad, made = _build(s, op, base, inputs, params, p)
        p += op.nparams
        outs = _outs(op, base)
        s.refs = {id(t): tid for t, tid in made}
        try:
            cancel_message(s, seq, _RUN_SPEC, _message(op, args, kwargs, outs))
        finally:
            s.refs = {}


def cancel(s: SessionState, seq: int, spec: Any, msg: list) -> None:
    """A REPLAY an interrupt cancelled before it started: every op of it is cancelled."""
    sequence, inputs = _continue_run(s, seq, msg)
    _, _, start, stop, base, _, params = msg
    _cancel_ops(s, seq, sequence.ops[start:stop], base, inputs, params, 0)
