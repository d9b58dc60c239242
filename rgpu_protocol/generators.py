"""A generator the client made with `torch.Generator(device="rgpu")`, named in an op's
`generator` argument and in GENERATOR / GENERATOR_STATE messages.

The reference carries what the server needs to make the generator the first time it is named:
its device (an index among the server's devices) and the seed it starts from. So the client
never waits to create one, and a session that has not seen it yet (a new session after a
reconnect) starts it from the client's last seed.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import msgpack

from .errors import ProtocolError

EXT_GENERATOR = 13  # u64 generator id, u8 device index, u64 seed
MAX_GENERATORS = 1024  # live generators in one session

_GEN = struct.Struct("<QBQ")


@dataclass(frozen=True, slots=True)
class GeneratorRef:
    id: int
    device: int  # index among the server's devices
    seed: int  # the seed a generator made now starts from


def generator_ext(gen_id: int, device: int, seed: int) -> msgpack.ExtType:
    return msgpack.ExtType(EXT_GENERATOR, _GEN.pack(gen_id, device, seed & 0xFFFF_FFFF_FFFF_FFFF))


def decode_generator(data: bytes) -> GeneratorRef:
    if len(data) != _GEN.size:
        raise ProtocolError(f"generator reference must be {_GEN.size} bytes")
    return GeneratorRef(*_GEN.unpack(data))
