"""Lazy modules (`nn.LazyLinear`, `LazyConv2d`, `LazyBatchNorm2d`, ...) on rgpu before their
first forward: `model.to("rgpu")`, and `device="rgpu"` at construction.

Why: PyTorch keeps a lazy module's parameter as an empty tensor of a subclass of its own
(`UninitializedParameter`) until the first forward gives it a shape, and materializes it in
place, on the device of that empty tensor. An rgpu tensor is a wrapper subclass, which such an
empty tensor cannot be. So the empty tensor stays on the CPU (in the dtype it was moved to) and
remembers the rgpu device; the first forward materializes and initializes it on the CPU, as the
module's own `reset_parameters` does it there, and then moves it to that device. The module's
parameter is a new object after that first forward (CUDA keeps the same): PyTorch asks for an
optimizer to be made after the first forward of a lazy module anyway.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.parameter import UninitializedBuffer, UninitializedParameter, UninitializedTensorMixin

from .tensor import DEVICE_TYPE

_TARGET = "_rgpu_target"  # the rgpu device an uninitialized tensor is bound for
_installed = False


def _rgpu_device(device: Any) -> torch.device | None:
    if device is None:
        return None
    d = torch.device(device) if not isinstance(device, torch.device) else device
    if d.type != DEVICE_TYPE:
        return None
    return d if d.index is not None else torch.device(DEVICE_TYPE, torch.rgpu.current_device())


def _moved(cls: type, func: Any, args: tuple, kwargs: dict) -> Any:
    """`.to(...)` or `.rgpu()` of an uninitialized tensor bound for rgpu: the CPU placeholder,
    marked with its target; NotImplemented for every other call."""
    name = getattr(func, "__name__", None)
    if name == "to":
        device, dtype, _, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
    elif name == DEVICE_TYPE:  # Tensor.rgpu(device=None, ...)
        given = args[1] if len(args) > 1 else kwargs.get("device")
        device = torch.device(DEVICE_TYPE, given) if isinstance(given, int) else given
        device, dtype = device or torch.device(DEVICE_TYPE), None
    else:
        return NotImplemented
    target = _rgpu_device(device)
    if target is None:
        return NotImplemented
    self = args[0]
    out = self
    if dtype is not None and dtype != self.dtype:
        out = _original_torch_function.__func__(cls, torch.Tensor.to, (cls,), (self, dtype), {})
    for t in (self, out):  # Module._apply keeps the parameter and sets its .data to `out`
        setattr(t, _TARGET, target)
    return out


def _torch_function(cls: type, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
    kwargs = kwargs or {}
    if args and isinstance(args[0], UninitializedTensorMixin):
        out = _moved(cls, func, args, kwargs)
        if out is not NotImplemented:
            return out
    return _original_torch_function.__func__(cls, func, types, args, kwargs)


def _new(original: Any) -> Any:
    def __new__(cls: type, *args: Any, **kwargs: Any) -> Any:
        device = kwargs.get("device", args[1] if len(args) > 1 else None)
        target = _rgpu_device(device)
        if target is None:
            return original(cls, *args, **kwargs)
        if len(args) > 1:
            args = (args[0], None, *args[2:])
        else:
            kwargs["device"] = None
        t = original(cls, *args, **kwargs)
        setattr(t, _TARGET, target)
        return t

    return __new__


def _copied(original: Any) -> Any:
    def __deepcopy__(self: Any, memo: dict) -> Any:  # copy.deepcopy(model) before its forward
        out = original(self, memo)
        if hasattr(self, _TARGET):
            setattr(out, _TARGET, getattr(self, _TARGET))
        return out

    return __deepcopy__


def _materialized_then_moved(original: Any) -> Any:
    """`original` (a lazy module's first forward hook, or its state-dict load hook, which
    materialize its tensors on the CPU), then the tensors bound for rgpu moved there."""

    def hook(self: Any, *args: Any, **kwargs: Any) -> Any:
        bound = [
            (table, name, getattr(t, _TARGET))
            for table in (self._parameters, self._buffers)
            for name, t in table.items()
            if isinstance(t, UninitializedTensorMixin) and hasattr(t, _TARGET)
        ]
        result = original(self, *args, **kwargs)
        with torch.no_grad():
            for table, name, device in bound:
                t = table[name]
                if t is None or isinstance(t, UninitializedTensorMixin):
                    continue  # not materialized (a load that lacks it)
                if isinstance(t, torch.nn.Parameter):
                    table[name] = torch.nn.Parameter(t.detach().to(device), t.requires_grad)
                else:
                    table[name] = t.to(device)
        return result

    return hook


_original_torch_function = UninitializedTensorMixin.__dict__["__torch_function__"]


def install() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    UninitializedTensorMixin.__torch_function__ = classmethod(_torch_function)  # type: ignore[assignment]
    for cls in (UninitializedParameter, UninitializedBuffer):
        cls.__new__ = _new(cls.__new__)  # type: ignore[method-assign]
        cls.__deepcopy__ = _copied(cls.__deepcopy__)  # type: ignore[method-assign]
    for name in ("_infer_parameters", "_lazy_load_hook"):
        setattr(LazyModuleMixin, name, _materialized_then_moved(getattr(LazyModuleMixin, name)))
