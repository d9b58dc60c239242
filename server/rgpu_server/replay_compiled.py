"""Stretches of a replayed sequence as one generated Python function: straight-line calls.

Why: the replay loop interprets each op (copy its argument list, walk its slots, look each
tensor up, branch on its kind), about as much Python as the op's own call; on a GPU host that
is what caps ops per second. The common op of a sequence is `SeqOp.simple` with one output:
plain, its tensors by slot straight in its arguments. A run of such ops becomes one function
whose body calls them in order with their constants bound by name, keeps each output in a local
for the ops that read it, and stores it under its id as the loop would.

Semantics stay the loop's: the function stops at the first op it cannot run as the loop's hot
path would (an input missing or poisoned, a CANCEL that arrived, an output that is not one plain
tensor, an exception) and says where; the loop (rgpu_server.replay) takes that op and the rest
the ordinary way. Only names and integers generated here go into the source; every value from
the client is bound in the function's namespace, never written into its text.
"""

from __future__ import annotations

from typing import Any

import torch

from rgpu_protocol import SlotKind

from .poison import Poison

_OUT = SlotKind.OUT
MIN_OPS = 4  # a shorter stretch runs in the loop: compiling it would not pay
_MAX_CACHED = 256  # compiled stretches per sequence


def compilable(op: Any) -> bool:
    return op.simple is not None and op.single and op.one_tensor


def stretch(ops: list, start: int, stop: int) -> int:
    """The end of the run of compilable ops from `start` (at most `stop`)."""
    end = start
    while end < stop and compilable(ops[end]):
        end += 1
    return end


def forget(sequence: Any) -> None:
    """An op stopped being compilable: the stretches are built again."""
    sequence.compiled.clear()
    sequence.stretch_ends.clear()


def build(ops: list, start: int, end: int) -> Any:
    """The function running ops[start:end]: (tensors, base, inputs, stream, seq, store) ->
    (ops done, the exception of the next op or None)."""
    ns: dict[str, Any] = {"Poison": Poison, "Tensor": torch.Tensor}
    lines = ["def run(T, base, I, S, seq, store):", "    k = 0", "    try:"]
    local_of: dict[int, str] = {}  # out offset -> the local holding it (made in this stretch)
    for k in range(start, end):
        op = ops[k]
        i = k - start
        ns[f"f{i}"] = op.call
        args = [None] * len(op.args)
        for pos, value in enumerate(op.args):
            ns[f"c{i}_{pos}"] = value
            args[pos] = f"c{i}_{pos}"
        lines.append(f"        k = {i}")
        lines.append(f"        if S.cancel_upto >= seq: return {i}, None")
        for pos, kind, index in op.simple:
            name = f"a{i}_{pos}"
            if kind == _OUT and index in local_of:
                args[pos] = local_of[index]
                continue
            where = f"base + {int(index)}" if kind == _OUT else f"I[{int(index)}]"
            lines.append(f"        {name} = T.get({where})")
            lines.append(f"        if {name} is None or type({name}) is Poison: return {i}, None")
            args[pos] = name
        call = ", ".join(args)
        if op.kwargs:
            ns[f"kw{i}"] = op.kwargs
            call = f"{call}, **kw{i}" if call else f"**kw{i}"
        out = int(op.outs[0])
        lines.append(f"        r{i} = f{i}({call})")
        lines.append(f"        if type(r{i}) is not Tensor:")
        lines.append(f"            store({k}, r{i})")
        lines.append(f"            return {i + 1}, None")
        lines.append(f"        T[base + {out}] = r{i}")
        local_of[out] = f"r{i}"
    lines.append(f"        return {end - start}, None")
    lines.append("    except Exception as e:")
    lines.append("        return k, e")
    exec(compile("\n".join(lines), f"<replayed ops {start}-{end}>", "exec"), ns)  # noqa: S102
    return ns["run"]


def cached(sequence: Any, start: int, stop: int) -> tuple[Any, int]:
    """(the compiled function for the stretch from `start`, its end), or (None, start): too
    short, or the sequence holds as many compiled stretches as it may (the loop runs it)."""
    ends = sequence.stretch_ends
    if not ends:
        ops = sequence.ops
        ends.extend(stretch(ops, k, len(ops)) for k in range(len(ops)))
    end = min(ends[start], stop)
    if end - start < MIN_OPS:
        return None, start
    key = (start, end)
    fn = sequence.compiled.get(key)
    if fn is None:
        if len(sequence.compiled) >= _MAX_CACHED:
            return None, start
        fn = sequence.compiled[key] = build(sequence.ops, start, end)
    return fn, end
