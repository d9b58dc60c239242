"""`pin_memory()` while rgpu is PyTorch's current accelerator.

Registering rgpu makes it the current accelerator, and CPU pinning then asks rgpu for a
page-locked allocator, which a Python backend cannot provide: `pin_memory()` and
`DataLoader(pin_memory=True)` would fail. Page-locked memory only speeds up DMA to a local device;
rgpu moves bytes over a socket, so "pinned for rgpu" is a contiguous copy, remembered so that
`is_pinned()` answers True for it. Pinning for another device (`pin_memory("cuda")`) goes to
PyTorch's own kernel.
"""

from __future__ import annotations

import weakref

import torch

_pinned: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
_COMPOSITE = torch._C.DispatchKeySet("CompositeExplicitAutograd")
_libs: list = []


def _for_rgpu(device: torch.device | None) -> bool:
    return device is None or torch.device(device).type == "rgpu"


def _pin_memory(self: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    if not _for_rgpu(device):
        return torch.ops.aten._pin_memory.default.redispatch(_COMPOSITE, self, device)
    out = torch.empty_like(self, memory_format=torch.contiguous_format).copy_(self)
    _pinned[out.data_ptr()] = out
    return out


def _is_pinned(self: torch.Tensor, device: torch.device | None = None) -> bool:
    if not _for_rgpu(device):
        return torch.ops.aten.is_pinned.default.redispatch(_COMPOSITE, self, device)
    held = _pinned.get(self.data_ptr())
    return (
        held is not None and held.untyped_storage().data_ptr() == self.untyped_storage().data_ptr()
    )


def install() -> None:
    if _libs:
        return
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_pin_memory", _pin_memory, "CPU")
    lib.impl("is_pinned", _is_pinned, "CPU")
    _libs.append(lib)
