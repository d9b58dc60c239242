"""`torch.load(f, map_location="rgpu")`: a clear error instead of a crashed process.

PyTorch restores a storage on a PrivateUse1 device by copying into the storage of a fresh device
tensor; an rgpu tensor's storage holds no memory (its data is on the server), so that copy
killed the Python process (a segmentation fault, the notebook's kernel gone). Storages cannot be
made on rgpu, so the checkpoint is loaded on the CPU and moved, which this error says how to do.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import torch

_LOCATION = re.compile(r"^rgpu(:\d+)?$")


def _restore(storage: Any, location: str) -> Any:
    """torch.serialization's deserializer, ahead of PyTorch's own for "rgpu" locations."""
    if not isinstance(location, str) or not _LOCATION.match(location):
        return None
    raise RuntimeError(
        f"torch.load cannot place a checkpoint's storages on {location!r} directly: rgpu "
        "tensors have no local storage. Load on the CPU and move them, as one step: "
        "`model.load_state_dict(torch.load(f, map_location='cpu'))` copies into rgpu "
        "parameters, or `{k: v.to('rgpu') for k, v in torch.load(f, map_location='cpu').items()}`"
        "; a file on the GPU host loads there, without passing through this machine, with "
        "rgpu.files.load (torch.save files) or rgpu.files.load_file (safetensors)."
    )


@functools.cache
def install() -> None:
    """Registered ahead of PyTorch's PrivateUse1 deserializer (priority 23)."""
    torch.serialization.register_package(19, lambda storage: None, _restore)
