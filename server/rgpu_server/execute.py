"""Running aten ops for a session: RUN (outputs under the client's ids), RUN_DYN (outputs only
the data can tell, answered with their metadata) and FREE.

A failed op poisons its outputs and the tensors it writes; the first failure is reported at the
client's next wait (`Session.error_pending`).
"""

from __future__ import annotations

from typing import Any

import torch

from rgpu_protocol import MAX_DYNAMIC_OUTPUTS, Kind, ProtocolError, Status, TensorMeta

from . import rng
from .bindings import by_types
from .ops import OpRefused, resolve
from .ops import _cache as _resolved
from .poison import Poison, describe
from .quota import factory_bytes
from .state import SessionState


def flatten(result: Any) -> list:
    """An op's result as the flat list of values its out ids name (one level of nesting)."""
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, (tuple, list)):
        flat: list = []
        for r in result:
            if isinstance(r, (tuple, list)):
                flat.extend(r)
            else:
                flat.append(r)
        return flat
    return [result]


def call(s: SessionState, resolved: Any, args: list, kwargs: dict | None) -> Any:
    """Run a resolved op with the session's generator."""
    kwargs = kwargs or {}
    if resolved.takes_generator:
        pos = resolved.generator_pos
        if 0 <= pos < len(args):  # a positional generator (poisson, binomial, rrelu)
            if args[pos] is None:
                args = [*args[:pos], s.generator, *args[pos + 1 :]]
            return resolved.op(*args, **kwargs)
        if kwargs.get("generator") is None:
            kwargs["generator"] = s.generator
        return resolved.op(*args, **kwargs)
    if resolved.seeded:
        with rng.session_state(s.generator, s.device):
            return resolved.call(*args, **kwargs)
    return resolved.call(*args, **kwargs)


def run(s: SessionState, seq: int, msg: list) -> None:
    name, args, kwargs, outs = msg[1], msg[2], msg[3], msg[4]
    if len(msg) == 5 and len(outs) == 1 and s.bad is None and s.quota is None:
        # the hot path: one output, nothing to check, no quota
        resolved = _resolved.get(name) if type(name) is str else None
        if resolved is not None and resolved.plain:
            if kwargs:
                fn = resolved.call
            else:
                key = tuple(map(type, args))
                fn = resolved.by_types.get(key)
                if fn is None:
                    fn = by_types(resolved, args, key)
            try:
                result = fn(*args, **kwargs) if kwargs else fn(*args)
            except Exception as e:
                s.fail(resolved.label, describe(e), [*outs, *s.written_ids(resolved, args, kwargs)])
                return
            s.ops_run += 1
            i = outs[0]
            if type(result) is torch.Tensor and type(i) is int:
                s.tensors[i] = result
                return
            store(s, resolved, msg, outs, result)
            return
    try:
        resolved = resolve(name)
    except OpRefused as e:
        s.fail(f"aten::{name}", f"OpRefused: {e}", outs)
        return
    if s.bad is not None:
        s.pass_on_bad(resolved.label, [*outs, *s.written_ids(resolved, args, kwargs)])
        return
    if s.quota is not None and resolved.factory:
        need = factory_bytes(resolved, args, kwargs)
        if not s.quota.fits(need):
            s.fail(resolved.label, s.quota.message(need), outs)
            return
    try:
        result = call(s, resolved, args, kwargs)
    except Exception as e:
        s.fail(resolved.label, describe(e), [*outs, *s.written_ids(resolved, args, kwargs)])
        return
    s.ops_run += 1
    store(s, resolved, msg, outs, result)


def store(s: SessionState, resolved: Any, msg: list, outs: list, result: Any) -> None:
    """Keep an op's outputs under the client's ids."""
    if not outs:
        return
    if len(outs) == 1 and type(result) is torch.Tensor:
        flat = [result]
    else:
        flat = flatten(result)
        if len(flat) != len(outs):
            s.fail(
                resolved.label, f"op returned {len(flat)} values, client expected {len(outs)}", outs
            )
            return
    if len(msg) > 5 and msg[5] is not None:
        flat = check_expected(s, resolved.label, flat, msg[5], outs)
        if flat is None:
            return
    tensors = s.tensors
    for i, v in zip(outs, flat):
        if i is not None:
            if type(i) is not int:
                raise ProtocolError("output ids must be integers or null")
            if isinstance(v, torch.Tensor):
                tensors[i] = v
            elif v is not None:  # None: an undefined optional output (e.g. a masked-out grad)
                s.fail(resolved.label, f"expected a tensor output, got {type(v).__name__}", outs)
                return
    if s.quota is not None:
        s.charge(resolved.label, outs)


def _layout(meta: tuple) -> str:
    """`float32 [4, 2] strides [1, 4] offset 0` (and conj/neg bits when set)."""
    dtype, shape, stride, offset, conj, neg = meta
    bits = (" conj" if conj else "") + (" neg" if neg else "")
    return f"{dtype} {shape} strides {stride} offset {offset}{bits}"


def check_expected(s: SessionState, label: str, flat: list, expect: Any, outs: list) -> list | None:
    """Check outputs against the client's predicted metadata; fail the op on any difference.

    The client makes views of an output from its prediction alone, so an output laid out
    otherwise would be read wrongly later: it is reported, never re-laid-out or replaced.
    Strides are compared where they address memory (dims of size > 1 of a non-empty tensor),
    as torch._prims_common.check_significant_strides does."""
    if type(expect) is not list or len(expect) != len(flat):
        raise ProtocolError("expected-metadata list does not match the outputs")
    for k, (v, e) in enumerate(zip(flat, expect)):
        if e is None or not isinstance(v, torch.Tensor):
            continue
        if type(e) is not TensorMeta:
            raise ProtocolError("expected metadata must be tensor metadata")
        if v.is_nested:  # has no one shape: never what the client described
            s.fail(label, "produced a nested tensor; rgpu expected a dense (strided) one", outs)
            return None
        shape, stride = list(v.shape), list(v.stride())
        got = (v.dtype, shape, stride, v.storage_offset(), v.is_conj(), v.is_neg())
        want = (e.dtype, list(e.shape), list(e.stride), e.offset, bool(e.conj), bool(e.neg))
        same = got[:2] == want[:2] and got[3:] == want[3:] and len(want[2]) == len(stride)
        if same and v.numel() > 0:
            same = all(n == 1 or a == b for n, a, b in zip(shape, stride, want[2]))
        if not same:
            s.meta_mismatches += 1
            s.fail(
                label,
                f"rgpu predicted output {k} as {_layout(want)} but the server produced "
                f"{_layout(got)}; please report this as an rgpu bug",
                outs,
            )
            return None
    return flat


def run_dynamic(s: SessionState, seq: int, msg: list) -> None:
    """An op whose output shapes only the data can tell: run now, answer with metadata."""
    _, name, args, kwargs, first_id = msg
    if first_id < 1:
        raise ProtocolError("RUN_DYN first_id must be a positive integer")
    if s.error_pending(seq):
        return
    try:
        resolved = resolve(name)
    except OpRefused as e:
        s.reply(seq, Status.ERROR, [f"aten::{name}", f"OpRefused: {e}"])
        return
    if s.bad is not None:
        s.reply(seq, Status.ERROR, s.bad_reply(resolved.label))
        return
    try:
        result = call(s, resolved, args, kwargs)
    except Exception as e:  # raised at the op, as on the CPU: what it writes stays usable,
        s.reply(seq, Status.ERROR, [resolved.label, describe(e)])  # not poisoned
        return
    s.ops_run += 1
    flat = flatten(result)
    problem = None
    if len(flat) > MAX_DYNAMIC_OUTPUTS:
        problem = f"returned {len(flat)} values; at most {MAX_DYNAMIC_OUTPUTS} are supported"
    else:
        for v in flat:
            if isinstance(v, torch.Tensor) and (v.layout != torch.strided or v.is_nested):
                kind = "nested" if v.is_nested else str(v.layout)
                problem = f"produced a {kind} tensor; rgpu supports dense (strided) tensors only"
                break
    if problem is not None:
        s.reply(seq, Status.ERROR, [resolved.label, problem])
        return
    values: list = []
    stored = []
    next_id = first_id
    for v in flat:
        if isinstance(v, torch.Tensor):
            s.tensors[next_id] = v
            stored.append(next_id)
            next_id += 1
            values.append(
                TensorMeta(
                    v.dtype, tuple(v.shape), v.stride(), v.storage_offset(), v.is_conj(), v.is_neg()
                )  # fmt: skip
            )
        elif v is None or type(v) in (bool, int, float, complex, str, torch.dtype):
            values.append(v)
        else:
            values.append(str(v))
    if s.quota is not None and not s.charge(resolved.label, stored, report=False):
        s.reply(seq, Status.ERROR, [resolved.label, s.quota.message()])
        return
    s.reply(seq, Status.OK, values)


def free(s: SessionState, seq: int, msg: list) -> None:
    pop = s.tensors.pop
    if s.quota is not None:
        for i in msg[1]:
            if type(i) is int:
                s.quota.uncharge(i)
    for i in msg[1]:
        if type(i) is int:
            pop(i, None)


CANCELLED = (
    "cancelled: an interrupt (Ctrl-C) on the client stopped the work queued before it, and "
    "the server had not started this op"
)


def _keeps_layout(resolved: Any) -> bool:
    """An op whose skipped write leaves its targets as the client sees them: one that writes
    in place without changing their shape (not `resize_`, `unsqueeze_`, `set_`: inplace_view),
    and no out= (the client resized its outputs already where they had another shape)."""
    op = resolved.op
    if torch.Tag.inplace_view in op.tags or "resize" in op._schema.name:
        return False
    return all(pos >= 0 and name != "out" for pos, name in resolved.writes)


def cancel(s: SessionState, seq: int, spec: Any, msg: list) -> None:
    """An interrupt cancelled this message before it ran: its new outputs are poisoned with that
    reason, a waited one is answered so; no error waits for the next wait. A tensor it would have
    written in place keeps its value, as when a local program is interrupted before that line:
    what the server ran stands, what it had not started never happened. Targets whose shape the
    client already changed (`unsqueeze_`, out= resizes) are poisoned: they no longer agree."""
    kind = msg[0]
    if spec.waited:
        s.reply(seq, Status.ERROR, ["cancelled", CANCELLED])
        return
    outs = msg[3] if kind == Kind.CALL else msg[4]
    label = "cancelled op"
    written: list[int] = []
    kept: list[int] = []
    if kind == Kind.RUN:
        try:
            resolved = resolve(msg[1])
            label = resolved.label
            written = s.written_ids(resolved, msg[2], msg[3])
            kept = written if _keeps_layout(resolved) else []
        except OpRefused:
            pass
    poison = Poison(label, CANCELLED, seq)
    for i in [*outs, *written]:
        if type(i) is int and i not in kept:
            if s.quota is not None:
                s.quota.uncharge(i)
            s.tensors[i] = poison
