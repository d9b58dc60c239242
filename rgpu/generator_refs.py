"""The wire form of an rgpu generator (rgpu.generators), for the session's encoder.

PyTorch hands an op's `generator` argument to the device as a new Python object over the same
C++ generator, so the rgpu generator it stands for is found by that C++ object's address
(`_cdata`), which stays the same while the generator lives.
"""

from __future__ import annotations

import weakref
from typing import Any

import msgpack
import torch

from rgpu_protocol import EncodeError, generator_ext

from . import devices as _devices

LIVE: dict[int, weakref.ref] = {}  # C++ generator address -> the rgpu Generator over it


def wire(obj: Any) -> msgpack.ExtType:
    """A generator named in a message: its id, device on its server and seed."""
    ref = LIVE.get(obj._cdata)
    g = ref() if ref is not None else None
    if g is None:
        raise EncodeError(
            f"an rgpu op needs a generator made with torch.Generator(device='rgpu'), not one "
            f"on {obj.device}"
        )
    _, local = _devices.session_of(g._rgpu_index, None)
    return generator_ext(g._rgpu_id, local, g.initial_seed())


def state_bytes(new_state: Any, source: str) -> bytes:
    """A generator state (from `source`, named in the error) as the bytes the server sets."""
    if not isinstance(new_state, torch.Tensor) or new_state.dtype != torch.uint8:
        # as torch.cuda.set_rng_state: a state cast from another dtype is not the state
        got = new_state.dtype if isinstance(new_state, torch.Tensor) else type(new_state).__name__
        raise TypeError(f"expected a torch.ByteTensor (uint8) from {source}, but got {got}")
    return new_state.detach().cpu().contiguous().numpy().tobytes()


def state_tensor(state: bytes) -> torch.Tensor:
    """The server's reply to a state request as torch gives states: a CPU uint8 tensor."""
    return torch.frombuffer(bytearray(state), dtype=torch.uint8)
