"""PyTorch's generated Python bindings as the callables of ops, where provably the same call.

Why: an `OpOverload`'s C++ callable (`op._op`) matches its arguments against the schema at every
call, boxed; the generated binding of the same operator (`torch.add`, `Tensor.view`) parses them
with code written for it, about a microsecond less per call on a small op: on a GPU host, that
is a large part of what an op costs the server beyond its kernel.

A binding is only used where it hands the dispatcher exactly the call the overload would get. That
is proved, not assumed: both are called once on stand-in meta tensors under a dispatch mode that
records the first call reaching it and stops it there (no kernel runs), and the two records must
be equal (the same overload, the same arguments, each stand-in in the same place). The Python
argument parser picks an overload by the Python types of the arguments and by whether a tensor
is 0-dim (one also fits a Scalar parameter); the proof covers every tensor both ways, so it holds
for every later call whose arguments have the same types: the answer is kept per overload and
argument types.
"""

from __future__ import annotations

import os
from typing import Any

import torch

_MAX_KEYS = 4096
_MAX_TYPES_PER_OP = 64
_CONTAINERS = (list, tuple, dict)
_MAX_TENSORS = 4  # each tensor doubles the proof's cases (0-dim or not)
_found: dict[tuple, Any] = {}  # (overload, argument types) -> the binding, or None
_STAND_IN = torch.empty(0, device="meta")


class _Stop(Exception):
    pass


class _Record:
    """The first call that reaches the dispatcher's Python key, then a stop before any kernel.
    Pushed on the dispatch-mode stack directly: `TorchDispatchMode.__enter__` imports Dynamo (seconds,
    on a server that does not preload it) for nothing this needs."""

    def __init__(self) -> None:
        self.call: tuple | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.call = (func, args, kwargs or {})
        raise _Stop


def _record(fn: Any, args: tuple, kwargs: dict) -> tuple | None:
    mode = _Record()
    torch._C._push_on_torch_dispatch_stack(mode)
    try:
        fn(*args, **kwargs)
    except _Stop:
        return mode.call
    except Exception:  # the binding refuses these arguments (or takes another overload's)
        return None
    finally:
        torch._C._pop_torch_dispatch_stack(None)
    return None  # reached no kernel through the dispatcher: nothing to compare


def _proof_runs() -> bool:
    """Whether this torch takes a plain recording object on its dispatch-mode stack (private
    API): without it no binding is ever proved, and every op keeps its own callable."""
    try:
        return _record(torch._C._VariableFunctions.neg, (_STAND_IN,), {}) is not None
    except Exception:  # noqa: BLE001
        return False


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _types(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_types(v) for v in value))
    return type(value)


def _candidates(op: torch._ops.OpOverload) -> list[Any]:
    name = op._schema.name.split("::", 1)[1]
    found = []
    for space in (
        torch._C._VariableFunctions,
        torch._C.TensorBase,
        torch._C._nn,
        torch._C._linalg,
        torch._C._special,
        torch._C._fft,
    ):
        fn = getattr(space, name, None)
        if fn is not None and not name.startswith("__"):
            found.append(fn)
    return found


def _stand_in(value: Any, zero_dim: list[bool]) -> Any:
    """`value` with each tensor replaced by a meta stand-in, 0-dim where `zero_dim` says (taken
    in order)."""
    if isinstance(value, torch.Tensor):
        shape = () if zero_dim.pop(0) else (0,)
        return torch.empty(shape, device="meta", dtype=value.dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(_stand_in(v, zero_dim) for v in value)
    return value


def _count(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return 1
    if isinstance(value, (list, tuple)):
        return sum(_count(v) for v in value)
    return 0


def _proved(op: torch._ops.OpOverload, fn: Any, args: tuple, kwargs: dict, n: int) -> bool:
    """Whether `fn` makes `op`'s very call for these arguments with every tensor either 0-dim or
    not (a 0-dim tensor also fits a Scalar parameter, so the parser's choice may hang on it)."""
    for bits in range(1 << n):
        flags = [bool(bits >> i & 1) for i in range(n)]
        a = tuple(_stand_in(v, flags) for v in args)
        k = {name: _stand_in(v, flags) for name, v in kwargs.items()}
        want = _record(op._op, a, k)
        if want is None or want[0] is not op:
            return False
        got = _record(fn, a, k)
        if got is None or got[0] is not op:
            return False
        if not (_same(got[1], want[1]) and _same(got[2], want[2])):
            return False
    return True


def binding(op: torch._ops.OpOverload, args: tuple | list, kwargs: dict | None) -> Any:
    """The generated binding that makes exactly `op`'s call for arguments of these Python types,
    or None (then `op._op` it is). Tensors in `args` stand for any tensor of that dtype: only
    their places and dtypes are used."""
    kwargs = kwargs or {}
    try:
        key = (op, _types(tuple(args)), tuple((k, _types(v)) for k, v in kwargs.items()))
        hit = _found.get(key, _found)
    except TypeError:  # an unhashable argument: no binding
        return None
    if hit is not _found:
        return hit
    if len(_found) >= _MAX_KEYS:  # no room to keep another answer: no proof made every call
        return None
    n = _count(tuple(args)) + _count(tuple(kwargs.values()))
    chosen = None
    if n <= _MAX_TENSORS:
        for fn in _candidates(op):
            if _proved(op, fn, tuple(args), kwargs, n):
                chosen = fn
                break
    _found[key] = chosen
    return chosen


# RGPU_BINDINGS=0 calls every op through its OpOverload's callable
ENABLED = os.environ.get("RGPU_BINDINGS", "1") != "0" and _proof_runs()


def for_slots(resolved: Any, args: list, kwargs: dict | None, slots: Any) -> Any:
    """What to call for a replayed op whose tensors come in at the positions `slots` names
    ((position, ...) tuples): its binding where proved, else the op's own callable."""
    if not ENABLED or resolved.call is not resolved.op._op:  # off, or a kernel of this server's own
        return resolved.call
    filled = list(args)
    for pos, *_ in slots:
        filled[pos] = _STAND_IN
    return binding(resolved.op, filled, kwargs) or resolved.call


def by_types(resolved: Any, args: list, key: tuple) -> Any:
    """What to call for a RUN of `resolved` with these positional arguments and no keywords
    (`key`: their types), kept in `resolved.by_types`. Arguments holding lists are left to the
    op's own callable: the key would have to look inside them, on every call."""
    fn = resolved.call
    if len(resolved.by_types) >= _MAX_TYPES_PER_OP:  # no room to keep the answer: its own
        return fn
    if ENABLED and fn is resolved.op._op and not any(t in _CONTAINERS for t in key):
        fn = binding(resolved.op, args, None) or fn
    resolved.by_types[key] = fn
    return fn
