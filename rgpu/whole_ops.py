"""Ops PyTorch breaks into smaller ones only on devices that lack their kernel.

A few aten ops have CPU and CUDA kernels and also a `CompositeImplicitAutograd` formula that
the dispatcher uses for every other device. On rgpu the formula would run: several messages
where the CPU runs one kernel, and different rounding. `silu_backward` is one: SiLU's gradient
on rgpu differed from the CPU's in the last bits, so Llama's weights drifted from local CPU
torch's after the first optimizer step. An `AutogradPrivateUse1` kernel sends these ops whole;
when their own gradient is needed (double backward) the formula runs, as on the CPU.

`linear`, `matmul` and the softmaxes are composites everywhere, but without a gradient to record
they go whole as well: one dispatch and one message instead of three to five (a weight's `t`,
reshapes, `mm`), which cut the client's CPU per `linear` from ~108 to ~32 us here, the server
running the composition PyTorch's own C++ runs locally.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

aten = torch.ops.aten
# aten ops with a CPU kernel and a CompositeImplicitAutograd formula (tests/test_whole_ops.py
# finds them in the installed PyTorch and checks this list is complete)
WHOLE = ("silu_backward", "mish_backward", "native_channel_shuffle")
# CompositeImplicitAutograd ops that compute fresh outputs: when no gradient is needed (inference,
# generation) they go whole too and the server runs PyTorch's own composition of them, the very
# code local torch runs; with a gradient they break up here so autograd records their parts
WHOLE_WITHOUT_GRAD = ("linear", "matmul", "softmax.int", "log_softmax.int")


def _needs_grad(args: tuple, kwargs: dict) -> bool:
    if not torch.is_grad_enabled():
        return False
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor) and a.requires_grad:
            return True
        if isinstance(a, (list, tuple)) and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in a
        ):
            return True
    return False


def _kernel(op: torch._ops.OpOverload) -> Callable[..., Any]:
    # PyTorch's C++ formula, the one local torch runs; not `op.decompose`, which prefers a
    # Python port where one is registered (matmul's took ~7% of a Llama training step's client
    # time here)
    composite = torch._C.DispatchKey.CompositeImplicitAutograd

    def run(*args: Any, **kwargs: Any) -> Any:
        if _needs_grad(args, kwargs):
            return op._op_dk(composite, *args, **kwargs)
        with torch._C._AutoDispatchBelowAutograd():
            return op(*args, **kwargs)

    return run


def install(lib: torch.library.Library) -> None:
    for name in WHOLE + WHOLE_WITHOUT_GRAD:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(aten, packet), overload or "default")
        lib.impl(name, _kernel(op), "AutogradPrivateUse1")
