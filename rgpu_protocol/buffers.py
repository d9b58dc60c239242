"""Raw byte views of CPU tensors, without side effects on the tensor.

`Tensor.numpy()` would do, but it marks the tensor's storage as not resizable for good, which
would leak into user tensors (`x.resize_` failing after `x.to("rgpu")`). A ctypes view has no such
effect; the caller keeps the tensor alive while the view is in use.
"""

from __future__ import annotations

import ctypes

import torch


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous CPU tensor's bytes."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("byte_view needs a contiguous CPU tensor")
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray())
    buf = (ctypes.c_char * n).from_address(t.data_ptr())
    buf.owner = t  # the memoryview holds buf, buf holds the tensor: no dangling view
    return memoryview(buf).cast("B")
