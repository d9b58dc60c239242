"""The misbehaving link for tests: rgpu.netem's emulator (cuts, latency, a bandwidth cap)."""

from __future__ import annotations

import random
from collections.abc import Callable

from rgpu.netem import LinkEmulator


class FaultProxy(LinkEmulator):
    def __init__(self, target_port: int, *, latency_s: float = 0.0, **kwargs) -> None:
        """`latency_s` is one-way, as tests think of a cut-and-delay proxy."""
        super().__init__(target_port, rtt_s=2 * latency_s, **kwargs)


def random_budget(rng: random.Random, low: int, high: int) -> Callable[[], int]:
    return lambda: rng.randint(low, high)
