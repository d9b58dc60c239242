"""`torch.load(f, map_location="rgpu")`: each storage of the checkpoint is uploaded once and its
tensors are rebuilt as views of it, so tensors that shared a storage share it on rgpu too.

PyTorch restores a storage on a PrivateUse1 device by copying into the storage of a fresh device
tensor; an rgpu tensor's storage holds no memory here, so that copy killed the Python process (a
segmentation fault). This deserializer, ahead of PyTorch's own, uploads the bytes instead and
returns a storage that stands for the server's (`storage_ids`), over which `torch.load`'s
`set_(storage, offset, size, stride)` rebuilds each tensor (`special_ops._set_storage`).
"""

from __future__ import annotations

import functools
import re
from typing import Any

import torch

from . import storage_ids

_LOCATION = re.compile(r"^rgpu(:\d+)?$")


def _restore(storage: Any, location: str) -> Any:
    """torch.serialization's deserializer, ahead of PyTorch's own for "rgpu" locations."""
    if not isinstance(location, str) or not _LOCATION.match(location):
        return None
    # the bytes as they are, no copy
    host = torch.empty(0, dtype=torch.uint8, device="cpu").set_(storage)
    uploaded = host.to(location)
    return storage_ids.standing_for(uploaded, keep=uploaded)


@functools.cache
def install() -> None:
    """Registered ahead of PyTorch's PrivateUse1 deserializer (priority 23)."""
    torch.serialization.register_package(19, lambda storage: None, _restore)
