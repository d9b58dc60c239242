"""`model.to("rgpu")`, `model.half()` and their kin while an autograd graph still holds the
model's parameters (a forward's output kept in a notebook variable, a compiled model's graph).

A RemoteTensor is a wrapper subclass (torch.compile flattens it), and for those
`Module._apply` swaps each parameter with its converted copy (`torch.utils.swap_tensors`) where
a device's tensor gets its data replaced (`param.data = ...`). The swap refuses a parameter that
anything besides its gradient accumulator holds, so `model(x)` on the CPU with the output kept,
then `model.to("rgpu")`, failed with "Couldn't swap LayerNorm.weight" and left the model half
moved; CUDA moves it. The same went for `model.half()` of an rgpu model after a forward.

Here such a swap goes ahead for `Module._apply`: the parameter object keeps its identity and
takes the new tensor, as on CUDA; the old graph keeps the old tensor, and a backward through it
is refused at the accumulator (CUDA refuses that backward too, for a gradient of the wrong device
or dtype). Anywhere else, and with `torch.__future__.set_swap_module_params_on_conversion(True)`,
PyTorch's swap and its checks stay as they are.
"""

from __future__ import annotations

import copyreg
import sys
import weakref
from typing import Any

import torch

from . import backward_errors
from . import tensor as _tensor

_STALE = (
    "rgpu: this backward runs through a graph whose parameters were converted since "
    "(model.to(...), .half(), .float(), ...) after the forward that built it. Run backward "
    "before converting the model, or run the forward again after it."
)
_original_swap = torch.utils.swap_tensors
_installed = False


def _refuse_stale(grad_outputs: Any) -> Any:
    raise RuntimeError(_STALE)


def _swap(t1: torch.Tensor, t2: torch.Tensor) -> None:
    """What `swap_tensors` does, for a `t1` that a graph may still hold. That graph's gradient
    accumulator into `t1` is poisoned first, since its gradient would land in the old tensor
    (PyTorch's own poison raises inside the engine, which aborts the process on rgpu)."""
    for t, name in ((t1, "t1"), (t2, "t2")):
        if weakref.getweakrefs(t):
            raise RuntimeError(f"Cannot swap {name} because it has weakref associated with it")
    slots = set(copyreg._slotnames(t1.__class__))  # type: ignore[attr-defined]
    if slots != set(copyreg._slotnames(t2.__class__)):  # type: ignore[attr-defined]
        raise RuntimeError("Cannot swap t1 and t2 if they have different slots")
    if t1.requires_grad and t1.is_leaf and t1._use_count() > 1:  # a graph may hold it
        torch.autograd.graph.get_gradient_edge(t1).node.register_prehook(
            backward_errors.guarded(_refuse_stale)  # raised once the engine returns
        )
    for name in ("__class__", "__dict__"):
        held = getattr(t1, name)
        setattr(t1, name, getattr(t2, name))
        setattr(t2, name, held)
    for slot in slots:
        a, b = hasattr(t1, slot), hasattr(t2, slot)
        held = getattr(t1, slot, None)
        if b:
            setattr(t1, slot, getattr(t2, slot))
        elif a:
            delattr(t1, slot)
        if a:
            setattr(t2, slot, held)
        elif b:
            delattr(t2, slot)
    torch._C._swap_tensor_impl(t1, t2)


def swap_tensors(t1: torch.Tensor, t2: torch.Tensor) -> None:
    if (
        _tensor.RemoteTensor in (type(t1), type(t2))
        and not torch.__future__.get_swap_module_params_on_conversion()
        and sys._getframe(1).f_code is torch.nn.Module._apply.__code__
    ):
        _swap(t1, t2)
    else:
        _original_swap(t1, t2)


def install() -> None:
    """`Module._apply` looks `torch.utils.swap_tensors` up at each call."""
    global _installed
    if not _installed:
        _installed = True
        torch.utils.swap_tensors = swap_tensors
