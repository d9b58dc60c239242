"""`torch.rgpu`: the device module PyTorch looks up for the "rgpu" device type."""

from __future__ import annotations

import types

import torch

from . import current as _cur
from .protocol import Kind


def is_available() -> bool:
    """rgpu is always available: a server is started locally if none is configured."""
    return True


def is_initialized() -> bool:
    return True


def _is_in_bad_fork() -> bool:
    return False


def device_count() -> int:
    return 1


def current_device() -> int:
    return 0


def set_device(device: object) -> None:
    idx = torch.device(device).index if not isinstance(device, int) else device
    if idx not in (None, 0):
        raise ValueError(f"rgpu has one device, rgpu:0; cannot select {device!r}")


def synchronize(device: object = None) -> None:
    """Wait until the server has run everything sent so far (one wait)."""
    _cur.current().request((Kind.SYNC,))


def manual_seed(seed: int) -> None:
    """Seed this session's generator on the server (no wait)."""
    _cur.seed(int(seed))


def manual_seed_all(seed: int) -> None:
    _cur.seed(int(seed))


def get_device_name(device: object = None) -> str:
    """The server's device, e.g. "NVIDIA H200" or "CPU (x86_64, 16 cores)"."""
    return _cur.current().device_name


def memory_allocated(device: object = None) -> int:
    """Bytes of tensor storage this session holds on the server (one wait)."""
    return int(_cur.current().info()["bytes"])


def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.float16, torch.bfloat16]


module = types.ModuleType("torch.rgpu")
for _name in (
    "is_available", "is_initialized", "_is_in_bad_fork", "device_count", "current_device",
    "set_device", "synchronize", "manual_seed", "manual_seed_all", "get_device_name",
    "memory_allocated", "get_amp_supported_dtype",
):  # fmt: skip
    setattr(module, _name, globals()[_name])
