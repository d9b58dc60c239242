"""Ops PyTorch breaks into smaller ones only on devices that lack their kernel.

A few aten ops have CPU and CUDA kernels and also a `CompositeImplicitAutograd` formula that
the dispatcher uses for every other device. On rgpu the formula would run: several messages
where the CPU runs one kernel, and different rounding. `silu_backward` is one: SiLU's gradient
on rgpu differed from the CPU's in the last bits, so Llama's weights drifted from local CPU
torch's after the first optimizer step. An `AutogradPrivateUse1` kernel sends these ops whole;
when their own gradient is needed (double backward) the formula runs, as on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

aten = torch.ops.aten
# aten ops with a CPU kernel and a CompositeImplicitAutograd formula (tests/test_whole_ops.py
# finds them in the installed PyTorch and checks this list is complete)
WHOLE = ("silu_backward", "mish_backward", "native_channel_shuffle")


def _needs_grad(args: tuple) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(a, torch.Tensor) and a.requires_grad for a in args
    )


def _kernel(op: torch._ops.OpOverload) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        if _needs_grad(args):
            return op.decompose(*args, **kwargs)
        with torch._C._AutoDispatchBelowAutograd():
            return op(*args, **kwargs)

    return run


def install(lib: torch.library.Library) -> None:
    for name in WHOLE:
        lib.impl(name, _kernel(getattr(aten, name).default), "AutogradPrivateUse1")
