"""Copies from server to server: how one rgpu server fetches a tensor another one exported.

A client holding tensors on two servers copies between them without the bytes passing through
it: it posts EXPORT [src, capability] to the source server, which snapshots the tensor's bytes
(at that point of its stream) under a fresh random capability, and IMPORT [dst, url,
capability] to the destination server, whose worker opens a websocket to the source's
`PEER_PATH` with the capability in `CAPABILITY_HEADER`. The capability stands in for the source
server's token: it is good for that one tensor, once, for `EXPORT_TTL_S`. The source answers
with one header frame (`peer_header`: dtype, shape, byte count, or an error), then the bytes in
binary frames of at most `PEER_CHUNK` bytes. Headers only; no I/O here.
"""

from __future__ import annotations

import msgpack
import torch

from .codec import CODE_TO_DTYPE, DTYPE_TO_CODE
from .errors import ProtocolError

PEER_PATH = "/peer"
CAPABILITY_HEADER = "X-Rgpu-Capability"
CAPABILITY_BYTES = 16
PEER_CHUNK = 4 << 20  # bytes per binary frame of a peer transfer
EXPORT_WAIT_S = 120.0  # how long a fetch waits for its EXPORT to run on the source server
EXPORT_TTL_S = 600.0  # how long an export waits to be fetched before it is dropped


def peer_header(dtype: torch.dtype, shape: tuple[int, ...], nbytes: int) -> bytes:
    return msgpack.packb({"dtype": DTYPE_TO_CODE[dtype], "shape": list(shape), "nbytes": nbytes})


def peer_error(message: str) -> bytes:
    """The header of a fetch that has no bytes to give: the export failed (a poisoned tensor)."""
    return msgpack.packb({"error": message})


class PeerRefused(Exception):
    """The source server had no bytes for this capability (its message says why)."""


def parse_peer_header(frame: bytes, max_bytes: int) -> tuple[torch.dtype, tuple[int, ...], int]:
    """(dtype, shape, nbytes) of a peer transfer; PeerRefused for an error header."""
    try:
        d = msgpack.unpackb(frame)
    except Exception as e:
        raise ProtocolError(f"a peer header must be a msgpack map ({e})") from None
    if type(d) is not dict:
        raise ProtocolError("a peer header must be a msgpack map")
    if "error" in d:
        raise PeerRefused(str(d["error"]))
    dtype = CODE_TO_DTYPE.get(d.get("dtype"))
    shape, nbytes = d.get("shape"), d.get("nbytes")
    if (
        dtype is None
        or type(shape) is not list
        or not all(type(n) is int and n >= 0 for n in shape)
        or type(nbytes) is not int
        or not 0 <= nbytes <= max_bytes
    ):
        raise ProtocolError("a peer header needs a dtype code, a shape and a byte count")
    return dtype, tuple(shape), nbytes
