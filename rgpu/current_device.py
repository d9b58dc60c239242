""" "rgpu" without an index in calls that PyTorch resolves in C++: the current device.

PyTorch gives a device index to an index-less device inside `Tensor.to` (`ensure_has_index`)
and when `torch.tensor(..., device=...)` and its kin copy their data over, asking the device
guard; the guard PyTorch registers for a Python backend always answers 0. So after
`torch.rgpu.set_device(1)`, `model.to("rgpu")` and `torch.tensor(data, device="rgpu")` landed on
rgpu:0, and `x.to("rgpu")` of a tensor on rgpu:1 copied it to rgpu:0 where CUDA returns it as it
is. Factories (`torch.empty(..., device="rgpu")`) reach rgpu's own kernels with no index and
were right already.

These entry points get the index filled in before PyTorch sees the device. They are wrapped only
once a thread makes another device than rgpu:0 current: until then 0 is the right answer, and
`Tensor.to`, which every model calls, stays PyTorch's own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._device as _device_context

from . import devices as _devices
from . import tensor as _tensor

_installed = False
_is_compiling = torch.compiler.is_compiling
_modes = torch._C._len_torch_function_stack
_mode_at = torch._C._get_function_stack_at


def _indexed(device: Any) -> Any:
    """`device` with the current device's index if it names rgpu without one."""
    if type(device) is str:
        if device == _tensor.DEVICE_TYPE:
            return torch.device(_tensor.DEVICE_TYPE, _devices.current())
        return device
    if type(device) is torch.device and device.type == _tensor.DEVICE_TYPE and device.index is None:
        return torch.device(_tensor.DEVICE_TYPE, _devices.current())
    return device


def _fill(
    fn: Callable[..., Any], positional: int | None, constructor: bool = False
) -> Callable[..., Any]:
    """`fn` with its `device` argument (keyword, or positional at `positional`) indexed; for a
    `constructor` given none, the device of a `with torch.device(...)` / `set_default_device`."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        # traced by torch.compile: PyTorch's own call, so the wrapper adds no graph break
        if _is_compiling():
            return fn(*args, **kwargs)
        if constructor and "device" not in kwargs and _modes():
            # a device context lies at the bottom of the mode stack: its device, given here (the
            # context finds the call by identity, in a table that may hold the wrapper)
            bottom = _mode_at(0)
            if type(bottom) is _device_context.DeviceContext:
                kwargs["device"] = _indexed(bottom.device)
        if _devices.current():
            device = kwargs.get("device")
            if device is not None:
                kwargs["device"] = _indexed(device)
            elif positional is not None and len(args) > positional:
                args = (*args[:positional], _indexed(args[positional]), *args[positional + 1 :])
        return fn(*args, **kwargs)

    return call


def install() -> None:
    """Wrap the entry points (once): the current device is about to be another than rgpu:0."""
    global _installed
    if _installed:
        return
    _installed = True
    # PyTorch finds these by identity. A `torch.device(...)` context (`torch.device("meta")`,
    # which transformers' loading asks about through `torch.tensor([]).device`) fills its table
    # on first use and is reached by PyTorch's own functions: fill it before the wrapping (the
    # wrappers also give the context's device themselves). A lazy module's uninitialized
    # parameter lets through the methods it lists, and a method reaches it as what
    # `torch.Tensor` holds, the wrapper.
    _device_context._device_constructors()
    # Tensor.to(device, ...) (args[0] is the tensor), Tensor.to(device=...); to(dtype) and
    # to(other) pass through
    torch.Tensor.to = _fill(torch.Tensor.to, 1)  # type: ignore[method-assign]
    torch.Tensor.new_tensor = _fill(torch.Tensor.new_tensor, None)  # type: ignore[method-assign]
    torch.tensor = _builtin(_fill(torch.tensor, None, True), torch.tensor)
    torch.as_tensor = _builtin(_fill(torch.as_tensor, None, True), torch.as_tensor)
    torch.nn.parameter.UninitializedTensorMixin._allowed_methods.append(torch.Tensor.to)


def _builtin(wrapper: Callable[..., Any], fn: Callable[..., Any]) -> Callable[..., Any]:
    """TorchScript compiles `torch.tensor(...)` as the aten op it knows the function as: the
    wrapper must be known as that op too, or scripting a function that calls it fails."""
    try:
        from torch.jit import _builtins

        op = _builtins._find_builtin(fn)
        if op is not None:
            _builtins._register_builtin(wrapper, op)
    except (ImportError, AttributeError):  # another torch's private API: scripting may fail
        pass
    return wrapper
