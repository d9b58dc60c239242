"""Composite ops whose C++ body takes another path for a tensor with the Python dispatch key (a
fake tensor, any subclass: every rgpu tensor) than for a device's tensor: rgpu takes the
device's path, so the layout is what a CUDA (or CPU) tensor gets.

`one_hot`'s functional path for subclasses, `eq(index.unsqueeze(-1), arange(n))`, lays the
output out like a transposed index (strides (5, 10, 1) where the device's `zeros().scatter_()`
gives (20, 5, 1)), so `view`s and `as_strided` reads differed from the CPU's.

`ctc_loss` with its lengths as CPU tensors (as cuDNN's kernel wants them, so CTC code keeps them
there) divides the loss by the target lengths for `reduction="mean"`: on CUDA the cuDNN path
takes them, on rgpu the division met a CPU tensor beside an rgpu one (refused, as CUDA's own
division refuses it). rgpu moves the lengths to the device first, as the cuDNN path reads them.
"""

from __future__ import annotations

from typing import Any

import torch

aten = torch.ops.aten


def one_hot(self: torch.Tensor, num_classes: int = -1) -> torch.Tensor:
    if self.dtype != torch.long:
        raise RuntimeError("one_hot is only applicable to index tensor of type LongTensor.")
    if self.numel() == 0:
        if num_classes <= 0:
            raise RuntimeError("Can not infer total number of classes from empty tensor.")
        return torch.empty((*self.shape, num_classes), dtype=torch.long, device=self.device)
    if num_classes == -1:
        num_classes = int(self.max().item()) + 1
    elif num_classes < 1:
        raise RuntimeError("num_classes should be positive")
    out = torch.zeros((*self.shape, num_classes), dtype=torch.long, device=self.device)
    # an index out of range is an error of the scatter on the device, as CUDA's device assert
    return out.scatter_(-1, self.unsqueeze(-1), 1)


def _composite(func: Any, args: tuple, kwargs: dict) -> Any:
    return one_hot(*args, **kwargs)


_IMPLICIT = torch._C.DispatchKey.CompositeImplicitAutograd


def ctc_loss(log_probs: torch.Tensor, targets: torch.Tensor, input_lengths: torch.Tensor,
             target_lengths: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:  # fmt: skip
    device = log_probs.device
    if input_lengths.device != device:
        input_lengths = input_lengths.to(device)
    if target_lengths.device != device:
        target_lengths = target_lengths.to(device)
    return aten.ctc_loss.Tensor._op_dk(
        _IMPLICIT, log_probs, targets, input_lengths, target_lengths, *args, **kwargs
    )


def install(lib: torch.library.Library, composite: dict) -> None:
    """The autograd kernels (one_hot has no gradient; ctc_loss's formula records its own) and
    their handlers in `composite` for when they reach the device with autograd skipped
    (inference mode)."""
    lib.impl("one_hot", one_hot, "AutogradPrivateUse1")
    composite[aten.one_hot.default] = _composite
    lib.impl("ctc_loss.Tensor", ctc_loss, "AutogradPrivateUse1")
    composite[aten.ctc_loss.Tensor] = lambda func, args, kwargs: ctc_loss(*args, **kwargs)
