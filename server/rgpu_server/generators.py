"""Generators a client made with `torch.Generator(device="rgpu")`: one server generator each,
made the first time a message names it (GeneratorRef carries its device and seed), seeded, set,
read and dropped by GENERATOR and GENERATOR_STATE.

A reference that cannot be honoured (a device this server lacks, too many generators) fails the
message naming it as a missing tensor would: the op's outputs are poisoned and the error is
reported at the client's next wait; the session goes on.
"""

from __future__ import annotations

from typing import Any

import torch

from rgpu_protocol import MAX_GENERATORS, GeneratorRef, ProtocolError, Status

from . import rng
from .poison import Poison, describe
from .state import SessionState


def resolve(s: SessionState, ref: GeneratorRef) -> torch.Generator | None:
    """The session's generator for `ref`, made now if new; None (and `s.bad`) if it can't be."""
    g = s.user_generators.get(ref.id)
    if g is not None:
        return g
    if not ref.device < len(s.devices):
        problem = f"it names device {ref.device}; this server has {len(s.devices)}"
    elif len(s.user_generators) >= MAX_GENERATORS:
        problem = (
            f"this session already holds {MAX_GENERATORS} generators; keep one generator and "
            "re-seed it (manual_seed) instead of making one per call"
        )
    else:
        g = torch.Generator(device=s.devices[ref.device])
        g.manual_seed(ref.seed)
        s.user_generators[ref.id] = g
        return g
    if s.bad is None:
        s.bad = Poison("generator", f"RuntimeError: cannot make the generator: {problem}",
                       s.stream.decoding)  # fmt: skip
        if s.first_error is None:
            s.first_error = (s.bad.label, s.bad.message, s.bad.seq)
    return None


def generator(s: SessionState, seq: int, msg: list) -> None:
    """GENERATOR [generator, value]: seed it (int), set its state (bytes), drop it (nil; the
    generator named by its id)."""
    g, value = msg[1], msg[2]
    if type(g) is int:
        if value is not None:
            raise ProtocolError("GENERATOR names a generator by id only to drop it (value nil)")
        s.user_generators.pop(g, None)
        return
    if g is None:
        return  # its reference failed: already reported
    if not isinstance(g, torch.Generator) or value is None:
        raise ProtocolError("GENERATOR takes a generator reference and a seed or a state")
    try:
        if type(value) is int:
            g.manual_seed(value & 0xFFFF_FFFF_FFFF_FFFF)
        else:
            rng.set_state(g, value)
    except RuntimeError as e:
        s.fail("Generator.set_state" if type(value) is bytes else "Generator.manual_seed",
               describe(e), ())  # fmt: skip


def state(s: SessionState, seq: int, msg: list) -> None:
    """GENERATOR_STATE [generator]: reply with its state."""
    if s.error_pending(seq):
        return
    g: Any = msg[1]
    if not isinstance(g, torch.Generator):
        s.reply(seq, Status.ERROR, ["Generator.get_state", "not a generator reference"])
        return
    s.reply(seq, Status.OK, rng.state_of(g))
