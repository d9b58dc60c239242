"""Each session's own random generator, also for ops that only draw from the device's default.

Ops with a `generator` argument get the session's generator. Seeded ops without one (and shipped
graphs with random ops) run with the session's state swapped into the device's default generator,
under a process-wide lock, and the state is swapped back out afterwards.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from rgpu_protocol import byte_view

_swap_lock = threading.Lock()  # guards the process-wide default generator during a swap


def state_of(generator: torch.Generator) -> bytes:
    """A generator's state as the wire carries it (RNG_GET, GENERATOR_STATE)."""
    return bytes(byte_view(generator.get_state()))


def set_state(generator: torch.Generator, state: bytes) -> None:
    """Set a state the client sent (RNG_SET, GENERATOR); RuntimeError if torch refuses it."""
    generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))


def default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index or 0]
    if device.type == "mps":
        return torch.mps._get_default_mps_generator()
    return torch.default_generator


@contextlib.contextmanager
def session_state(generator: torch.Generator, device: torch.device) -> Iterator[None]:
    """Run the body with `generator`'s state in the device's default generator."""
    default = default_generator(device)
    with _swap_lock:
        saved = default.get_state()
        default.set_state(generator.get_state())
        try:
            yield
        finally:
            generator.set_state(default.get_state())
            default.set_state(saved)
