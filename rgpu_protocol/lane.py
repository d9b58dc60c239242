"""The bulk lane: a second connection per session that carries large tensors as raw bytes.

A websocket costs a receiver several copies per byte (framing, unmasking, reassembly) and tops
out well below what the socket itself moves. So the client opens a second connection to the same
host and port, authenticated like the first (same token, plus the session id and the per-session
lane key from WELCOME, sent as headers of an HTTP upgrade to `LANE_PATH`). After the upgrade, both
ends stop speaking websocket frames and exchange records: a 17-byte header, then the payload.

    client -> server   PUT  ticket nbytes  + nbytes raw bytes   (stage an upload)
    server -> client   READY 0 0                                 (the lane is raw from here on)
    server -> client   ACK  ticket nbytes                        (all bytes of PUT `ticket` staged)
    server -> client   DATA ticket nbytes  + nbytes raw bytes   (the bytes of DOWNLOAD `ticket`)

The op stream stays on the websocket: an upload's UPLOAD message names its staged ticket and is
posted only after the ACK, so the server never waits on the lane while executing (an upload
interrupted on the client posts its UPLOAD with ticket 0, which poisons the destination). Headers
only; no I/O here.
"""

from __future__ import annotations

import enum
import struct

from .errors import ProtocolError

LANE_PATH = "/lane"
SESSION_HEADER = "X-Rgpu-Session"
KEY_HEADER = "X-Rgpu-Lane-Key"
HEADER_SIZE = 17
INTERRUPTED_TICKET = 0  # an UPLOAD naming it: the client gave up on the upload (Ctrl-C)
_HEADER = struct.Struct("!BQQ")


class LaneRecord(enum.IntEnum):
    READY = 0x52  # 'R'
    PUT = 0x50  # 'P'
    ACK = 0x4B  # 'K'
    DATA = 0x44  # 'D'


FROM_CLIENT = frozenset({LaneRecord.PUT})
FROM_SERVER = frozenset({LaneRecord.READY, LaneRecord.ACK, LaneRecord.DATA})


def lane_header(kind: LaneRecord, ticket: int, nbytes: int) -> bytes:
    return _HEADER.pack(kind, ticket, nbytes)


def parse_lane_header(
    header: bytes | bytearray | memoryview, allowed: frozenset, max_bytes: int
) -> tuple[LaneRecord, int, int]:
    """(kind, ticket, nbytes) of one record header; ProtocolError for a kind this end may not
    receive or a payload over `max_bytes`."""
    if len(header) != HEADER_SIZE:
        raise ProtocolError(f"a lane header is {HEADER_SIZE} bytes, not {len(header)}")
    code, ticket, nbytes = _HEADER.unpack(header)
    if code not in allowed:
        raise ProtocolError(f"unexpected lane record 0x{code:02x}")
    kind = LaneRecord(code)
    if kind in (LaneRecord.PUT, LaneRecord.DATA) and nbytes > max_bytes:
        raise ProtocolError(f"a lane record of {nbytes} bytes exceeds the limit of {max_bytes}")
    return kind, ticket, nbytes
