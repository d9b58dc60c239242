"""Which operators a client may run, found by name in `torch.ops.aten` and nowhere else.

No pickle, no eval, no attribute walk over `torch`: a name is checked against a strict pattern,
looked up on the aten namespace, and must come back as an `OpOverload`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

from rgpu_protocol import written_arguments

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\.[A-Za-z_][A-Za-z0-9_]*$")
_DUNDER = re.compile(r"^__[a-z]+__$")
_dunders: frozenset[str] | None = None


def _aten_dunder(base: str) -> bool:
    """Whether `base` names one of aten's own dunder operators (`__lshift__`, `__irshift__`,
    `__and__`, ...: what `t << 1` and `t <<= 1` dispatch to). Other names with `__` are refused
    before any lookup, so a name can never reach a Python attribute of the namespace object."""
    global _dunders
    if not _DUNDER.match(base):
        return False
    if _dunders is None:
        _dunders = frozenset(
            n.split("::", 1)[1].split(".", 1)[0]
            for n in torch._C._dispatch_get_all_op_names()
            if n.startswith("aten::__")
        )
    return base in _dunders


# Operators a client may not run, each with the reason. Keys are "name.overload" or "name" (every
# overload).
BLOCKED: dict[str, str] = {
    "from_file": "reads a file on the server's disk",
    "_print": "writes to the server's standard output",
    "_cufft_set_plan_cache_max_size": "changes process-wide cuFFT state shared by every session",
    "_cufft_clear_plan_cache": "changes process-wide cuFFT state shared by every session",
    "_assert_async": "a failed device-side assert poisons the CUDA context of every session",
    "_functional_assert_async": "a failed device-side assert poisons the CUDA context of every session",
    "set_.source_Storage": "aliases raw storage, which a client cannot name",
    "set_.source_Storage_storage_offset": "aliases raw storage, which a client cannot name",
    "set.source_Storage": "aliases raw storage, which a client cannot name",
    "set.source_Storage_storage_offset": "aliases raw storage, which a client cannot name",
    "set.source_Storage_storage_offset_out": "aliases raw storage, which a client cannot name",
    "record_stream": "takes a stream, which a client cannot name",
}


# Ops run as another op with the same arguments and the same values. `_efficientzerotensor` makes
# a ZeroTensor (no storage; autograd uses it for zero gradients), and later ops on one have crashed
# the server process; a real zero tensor behaves the same for every client-visible purpose.
SUBSTITUTES: dict[str, str] = {
    "_efficientzerotensor.default": "zeros.default",
    "_efficientzerotensor.out": "zeros.out",
}


# Ops this server's backend runs with a Python kernel in place of PyTorch's: `kernels.install`
# fills it at start-up (CUDA's semantics where the CPU kernel refuses an input CUDA takes).
CALLS: dict[str, Any] = {}


def _without_grad(op: torch._ops.OpOverload) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            return op._op(*args, **kwargs)

    return call


# Recurrent layers, whose CPU kernel depends on grad mode (oneDNN's runs only without it):
# clients send them whole only with grad mode off, so they run here with it off
for _name in (
    f"{rnn}.{o}" for rnn in ("lstm", "gru", "rnn_tanh", "rnn_relu") for o in ("input", "data")
):
    _packet, _, _overload = _name.partition(".")
    CALLS[_name] = _without_grad(getattr(getattr(torch.ops.aten, _packet), _overload))


class OpRefused(Exception):
    """The client named an operator it may not run; reported like any op failure."""


@dataclass(slots=True)
class ResolvedOp:
    op: torch._ops.OpOverload
    label: str  # "aten::add.Tensor"
    takes_generator: bool  # has a `generator` argument: pass the session's generator
    seeded: bool  # draws from the default generator without taking one: swap session state in
    writes: tuple[tuple[int, str], ...]  # (position or -1 if keyword-only, name) of written args
    factory: bool = False  # takes a device and no tensor: allocates from nothing
    call: Any = None  # the C++ callable behind `op` (skips OpOverload.__call__'s Python frame)
    plain: bool = False  # no generator to inject, no RNG state to swap: call it directly
    generator_pos: int = -1  # the generator's position where it is not keyword-only (poisson)
    by_types: dict = field(default_factory=dict)  # argument types -> what to call (bindings.py)


_cache: dict[str, ResolvedOp] = {}


def resolve(name: str) -> ResolvedOp:
    """Map "add.Tensor" to its OpOverload, or raise OpRefused with a reason."""
    if type(name) is not str:
        raise OpRefused(f"an operator name must be a string, not {type(name).__name__}")
    hit = _cache.get(name)
    if hit is not None:
        return hit
    if not _NAME.match(name):
        raise OpRefused(f"{name!r} is not an aten operator name (expected 'name.overload')")
    base, overload = name.split(".", 1)
    if "__" in overload or ("__" in base and not _aten_dunder(base)):
        raise OpRefused(f"{name!r} is not an aten operator name (expected 'name.overload')")
    why = BLOCKED.get(name) or BLOCKED.get(base)
    if why:
        raise OpRefused(f"aten::{name} is not allowed on an rgpu server: it {why}")
    if name in SUBSTITUTES:
        sub = resolve(SUBSTITUTES[name])
        resolved = ResolvedOp(
            sub.op,
            f"aten::{name}",
            sub.takes_generator,
            sub.seeded,
            sub.writes,
            sub.factory,
            sub.call,
            sub.plain,
            sub.generator_pos,
        )
        _cache[name] = resolved
        return resolved
    packet = getattr(torch.ops.aten, base, None)
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        raise OpRefused(f"no operator aten::{base} in this server's torch {torch.__version__}")
    if overload not in packet.overloads():
        raise OpRefused(f"aten::{base} has no overload {overload!r} in torch {torch.__version__}")
    op = getattr(packet, overload)
    if not isinstance(op, torch._ops.OpOverload):
        raise OpRefused(f"aten::{name} is not an operator")
    takes_gen = any(a.name == "generator" for a in op._schema.arguments)
    seeded = not takes_gen and torch.Tag.nondeterministic_seeded in op.tags
    writes = written_arguments(op._schema)
    args = op._schema.arguments
    factory = any(a.name == "device" for a in args) and not any(
        "Tensor" in str(a.type) for a in args
    )
    resolved = ResolvedOp(op, f"aten::{name}", takes_gen, seeded, writes, factory)
    resolved.call = CALLS.get(name, op._op)
    resolved.plain = not takes_gen and not seeded
    resolved.generator_pos = next(
        (i for i, a in enumerate(args) if a.name == "generator" and not a.kwarg_only), -1
    )
    _cache[name] = resolved
    return resolved
