"""`torch.accelerator` when rgpu is the process's accelerator.

Libraries that know no device by name (accelerate, transformers) call PyTorch's generic
accelerator API. For a backend written in Python that API reaches C++ pieces it cannot register:
the current device lives in a device guard that always answers 0, and the memory calls assert
that a C++ caching allocator exists (`accelerate.dispatch_model` dies in `empty_cache`). So
while rgpu is the current accelerator (no CUDA or other device in this process), these names
answer from `torch.rgpu`; otherwise PyTorch's own are left as they are.

transformers' `TrainingArguments.device` knows accelerators by name: past its list it takes the
CPU, though accelerate (which it asks first) answered rgpu through `torch.accelerator`. `Trainer`
then put the model on rgpu (accelerate) and every batch on the CPU. While rgpu is the current
accelerator, `TrainingArguments` keeps accelerate's answer (patched when transformers loads it),
and takes `bf16=True` (mixed precision through `torch.autocast("rgpu")`, as on a GPU).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from . import device_module as _rgpu
from .import_hooks import after_import
from .tensor import DEVICE_TYPE

_ORIGINAL: dict[str, Any] = {}


def set_device_index(device: Any, /) -> None:
    _rgpu.set_device(device)


def current_device_index() -> int:
    return _rgpu.current_device()


class device_index:
    """`with torch.accelerator.device_index(i):` the current rgpu device inside the block."""

    def __init__(self, device: int | None, /) -> None:
        self.inner = _rgpu.device(device)

    def __enter__(self) -> None:
        self.inner.__enter__()

    def __exit__(self, *exc: object) -> None:
        self.inner.__exit__(*exc)


def synchronize(device: Any = None, /) -> None:
    _rgpu.synchronize(device)


def empty_cache() -> None:
    """rgpu keeps no cache on the client; what it can release now are the tensors Python has
    already dropped, whose frees wait for the next batch: send them."""
    _rgpu.release_now()


def memory_allocated(device: Any = None, /) -> int:
    return _rgpu.memory_allocated(device)


def memory_reserved(device: Any = None, /) -> int:
    """The session's bytes: the server's allocator cache is shared by every session on it."""
    return _rgpu.memory_allocated(device)


def get_memory_info(device: Any = None, /) -> tuple[int, int]:
    """(free, total) bytes of the device on its server (host RAM for a CPU server)."""
    return _rgpu.mem_get_info(device)


_ANSWERS = {
    "set_device_index": set_device_index,
    "set_device_idx": set_device_index,
    "current_device_index": current_device_index,
    "current_device_idx": current_device_index,
    "device_index": device_index,
    "synchronize": synchronize,
    "empty_cache": empty_cache,
    "memory_allocated": memory_allocated,
    "memory_reserved": memory_reserved,
    "memory_stats": _rgpu.memory_stats,
    "get_memory_info": get_memory_info,
    "max_memory_allocated": _rgpu.no_peaks,
    "max_memory_reserved": _rgpu.no_peaks,
    "reset_peak_memory_stats": _rgpu.no_peaks,
    "reset_accumulated_memory_stats": _rgpu.no_peaks,
}


def install() -> bool:
    """Answer `torch.accelerator`'s calls for rgpu when rgpu is the current accelerator."""
    if _ORIGINAL:
        return True
    accel = getattr(torch, "accelerator", None)
    try:
        current = accel.current_accelerator() if accel is not None else None
    except RuntimeError:
        current = None
    if current is None or current.type != DEVICE_TYPE:
        return False
    after_import("transformers.training_args", _keep_accelerates_device)
    for name, answer in _ANSWERS.items():
        if hasattr(accel, name):
            _ORIGINAL[name] = getattr(accel, name)
            setattr(accel, name, answer)
    return True


def _keep_accelerates_device(module: Any) -> None:
    cls = getattr(module, "TrainingArguments", None)
    original = cls.__dict__.get("_setup_devices") if cls is not None else None
    if not isinstance(original, functools.cached_property):
        return  # another transformers: left as it is

    def _setup_devices(self: Any) -> torch.device:
        device = original.func(self)
        chosen = getattr(getattr(self, "distributed_state", None), "device", None)
        if device.type == "cpu" and not self.use_cpu and chosen is not None:
            if chosen.type == DEVICE_TYPE:
                return chosen
        return device

    patched = functools.cached_property(_setup_devices)
    patched.__set_name__(cls, "_setup_devices")
    cls._setup_devices = patched
    # `TrainingArguments(bf16=True)` asks whether a GPU it knows by name runs bfloat16 and, on
    # rgpu, refused: "Your setup doesn't support bf16/gpu"
    knows_bf16 = getattr(module, "is_torch_bf16_gpu_available", None)
    if callable(knows_bf16):

        def is_torch_bf16_gpu_available() -> bool:
            return knows_bf16() or (bool(_ORIGINAL) and _rgpu.is_bf16_supported())

        module.is_torch_bf16_gpu_available = is_torch_bf16_gpu_available
