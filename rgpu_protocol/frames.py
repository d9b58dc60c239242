"""Frames: what one websocket message holds, built and parsed without I/O.

A websocket message is a *frame*. Its first byte says what it is:

* ``HELLO`` / ``WELCOME`` / ``REFUSE`` -- the handshake, a msgpack map each.
* ``BATCH`` (client to server) -- the sequence number of its first message, then messages back to
  back; message *i* of the batch has sequence number ``first_seq + i``.
* ``BATCH_Z`` (client to server) -- a BATCH frame whose bytes after the kind byte are
  zlib-compressed. Only sent to a server whose WELCOME lists ``"zlib"`` under ``"compress"``.
* ``CHUNK`` (client to server) -- raw tensor bytes belonging to an UPLOAD message.
* ``REPLY`` (server to client) -- the answer to one waited message.
* ``DATA`` (server to client) -- raw tensor bytes belonging to a DOWNLOAD reply.
* ``ACK`` (server to client) -- the sequence number of the last message applied, so the client
  can drop what it keeps for replay after a dropped connection.
* ``PEEK`` / ``PEEK_REPLY`` -- live facts about the device and the session, asked and answered out
  of band: no sequence number, not behind the queued work (a live view polls them).

Messages, the items of a BATCH, are described in `messages`; the handshake in `handshake`.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator
from enum import IntEnum
from typing import Any

import msgpack

from .codec import DEFAULT_LIMITS, Limits, check_depth, default_ext_hook, make_unpacker, unpack_one
from .errors import LimitExceeded, ProtocolError
from .messages import Status


class Frame(IntEnum):
    BATCH = 0x01
    CHUNK = 0x02
    BATCH_Z = 0x03  # a BATCH frame, zlib-compressed after its kind byte
    CANCEL = 0x04  # u64: skip the work of every message up to this one not started yet
    PEEK = 0x05  # u64 token: answer at once with live facts (PEEK_REPLY), outside the stream
    REPLY = 0x11
    DATA = 0x12
    ACK = 0x13  # server to client: every message up to this sequence number has been applied
    PEEK_REPLY = 0x14  # u64 token, then a msgpack map of live facts
    HELLO = 0x20
    WELCOME = 0x21
    REFUSE = 0x22


class CloseCode(IntEnum):
    """Websocket close codes rgpu uses (4000-4999 are the application's)."""

    PROTOCOL_ERROR = 4002
    VERSION_MISMATCH = 4001
    BAD_HELLO = 4003
    SUPERSEDED = 4004  # the session resumed on a newer connection
    KEEP = 4006  # the client leaves its named session for a later client (not an end)
    TAKEN_OVER = 4007  # another client took this named session over (takeover=True)
    DROPPED = 4008  # the named session was dropped (rgpu.drop_session) or expired
    GOING_AWAY = 1001  # the server is shutting down
    BYE = 1000  # the client ended its session on purpose


ABORT_OFFSET = (1 << 64) - 1  # a CHUNK at this offset cancels the upload it belongs to

_SEQ_OFF = struct.Struct("<QQ")
_END = object()
_BATCH = bytes((Frame.BATCH,))
_BATCH_Z = bytes((Frame.BATCH_Z,))
_REPLY = bytes((Frame.REPLY,))


_U64 = struct.Struct("<Q")


def ack_frame(last_seq: int) -> bytes:
    return bytes((Frame.ACK,)) + _U64.pack(last_seq)


def cancel_frame(upto: int) -> bytes:
    return bytes((Frame.CANCEL,)) + _U64.pack(upto)


def parse_cancel(frame: bytes | memoryview) -> int:
    if len(frame) != 9:
        raise ProtocolError("CANCEL frame must hold one u64")
    return _U64.unpack_from(frame, 1)[0]


def peek_frame(token: int) -> bytes:
    return bytes((Frame.PEEK,)) + _U64.pack(token)


def parse_peek(frame: bytes | memoryview) -> int:
    if len(frame) != 9:
        raise ProtocolError("PEEK frame must hold one u64")
    return _U64.unpack_from(frame, 1)[0]


def peek_reply_frame(token: int, facts: dict) -> bytes:
    return bytes((Frame.PEEK_REPLY,)) + _U64.pack(token) + msgpack.packb(facts)


def parse_peek_reply(
    frame: bytes | memoryview, limits: Limits = DEFAULT_LIMITS
) -> tuple[int, dict]:
    """(token, facts) of a PEEK_REPLY frame."""
    if len(frame) < 10:
        raise ProtocolError("PEEK_REPLY frame too short")
    facts = unpack_one(memoryview(frame)[9:], limits)
    if type(facts) is not dict:
        raise ProtocolError("PEEK_REPLY must hold a map")
    return _U64.unpack_from(frame, 1)[0], facts


def parse_ack(frame: bytes | memoryview) -> int:
    if len(frame) != 9:
        raise ProtocolError("ACK frame must hold one u64")
    return _U64.unpack_from(frame, 1)[0]


def frame_kind(frame: bytes | bytearray | memoryview) -> Frame:
    if not frame:
        raise ProtocolError("empty frame")
    try:
        return Frame(frame[0])
    except ValueError:
        raise ProtocolError(f"unknown frame kind {frame[0]}") from None


# -- batches -------------------------------------------------------------------------------------


def batch_frame(first_seq: int, encoded_messages: list[bytes]) -> bytes:
    """Join already-encoded messages into one BATCH frame."""
    return b"".join((_BATCH, msgpack.packb(first_seq), *encoded_messages))


def compress_batch(frame: bytes, level: int = 1) -> bytes | None:
    """The BATCH_Z form of a BATCH frame, or None when it would not be smaller.

    Level 1: the op stream (names, ids, small shapes) shrinks several-fold even so, and it costs
    microseconds per kilobyte."""
    packed = zlib.compress(memoryview(frame)[1:], level)
    if len(packed) + 1 >= len(frame):
        return None
    return _BATCH_Z + packed


def decompress_batch(frame: bytes, limits: Limits = DEFAULT_LIMITS) -> bytes:
    """The BATCH frame inside a BATCH_Z frame; never inflates past `limits.max_message`."""
    if not frame or frame[0] != Frame.BATCH_Z:
        raise ProtocolError("not a BATCH_Z frame")
    inflater = zlib.decompressobj()
    try:
        body = inflater.decompress(memoryview(frame)[1:], limits.max_message)
    except zlib.error as e:
        raise ProtocolError(f"corrupt compressed batch: {e}") from None
    if inflater.unconsumed_tail:
        raise LimitExceeded(
            f"compressed batch inflates past the limit of {limits.max_message} bytes"
        )
    if not inflater.eof or inflater.unused_data:
        raise ProtocolError("compressed batch is truncated or has trailing bytes")
    return _BATCH + body


class BatchReader:
    """Iterates the messages of a BATCH frame one at a time.

    Lazy on purpose: the server resolves tensor references while decoding a message, so message
    *i* must be decoded only after message *i - 1* ran.
    """

    def __init__(self, frame: bytes, limits: Limits = DEFAULT_LIMITS, ext_hook=default_ext_hook):
        if len(frame) > limits.max_message:
            raise LimitExceeded(
                f"frame of {len(frame)} bytes exceeds the limit of {limits.max_message}"
            )
        if not frame or frame[0] != Frame.BATCH:
            raise ProtocolError("not a BATCH frame")
        self._limits = limits
        self._unpacker = make_unpacker(limits, ext_hook)
        self._unpacker.feed(memoryview(frame)[1:])
        self._size = len(frame) - 1
        first = self._next()
        if type(first) is not int or first < 1:
            raise ProtocolError("BATCH frame must start with a positive sequence number")
        self.first_seq: int = first

    def _next(self) -> Any:
        before = self._unpacker.tell()
        try:
            return self._unpacker.unpack()
        except msgpack.OutOfData:
            if before != self._size:
                raise ProtocolError("BATCH frame ends in the middle of a message") from None
            return _END
        except ProtocolError:
            raise
        except (ValueError, TypeError, msgpack.exceptions.UnpackException) as e:
            raise ProtocolError(f"malformed message in batch: {e}") from None

    def next_message(self) -> list | None:
        """The next message, or None at the end of the frame."""
        msg = self._next()
        if msg is _END:
            return None
        if type(msg) is not list or not msg or type(msg[0]) is not int:
            raise ProtocolError("a message must be an array that starts with its kind")
        check_depth(msg, self._limits.max_depth)
        return msg

    def __iter__(self) -> Iterator[list]:
        while (msg := self.next_message()) is not None:
            yield msg


# -- raw chunks ----------------------------------------------------------------------------------


def chunk_frame(kind: Frame, seq: int, offset: int, data: bytes | memoryview) -> list:
    """A CHUNK or DATA frame as a list of buffers (send them joined, or one after another)."""
    return [bytes((kind,)) + _SEQ_OFF.pack(seq, offset), data]


def parse_chunk(
    frame: bytes | memoryview, limits: Limits = DEFAULT_LIMITS
) -> tuple[int, int, memoryview]:
    """Split a CHUNK/DATA frame into (seq, offset, payload view)."""
    if len(frame) < 17:
        raise ProtocolError("chunk frame is truncated")
    if len(frame) - 17 > limits.max_chunk:
        raise LimitExceeded(
            f"chunk of {len(frame) - 17} bytes exceeds the limit of {limits.max_chunk}"
        )
    seq, offset = _SEQ_OFF.unpack_from(frame, 1)
    return seq, offset, memoryview(frame)[17:]


# -- replies -------------------------------------------------------------------------------------


def reply_frame(packer_pack, seq: int, status: Status, value: Any) -> bytes:
    """A REPLY frame; `packer_pack` is an Encoder's encode (so ext types work)."""
    return _REPLY + packer_pack([seq, int(status), value])


def parse_reply(
    frame: bytes, limits: Limits = DEFAULT_LIMITS, ext_hook=default_ext_hook
) -> tuple[int, Status, Any]:
    value = unpack_one(memoryview(frame)[1:], limits, ext_hook)
    if type(value) is not list or len(value) != 3 or type(value[0]) is not int:
        raise ProtocolError("a reply must be [seq, status, value]")
    try:
        status = Status(value[1])
    except ValueError:
        raise ProtocolError(f"unknown reply status {value[1]!r}") from None
    return value[0], status, value[2]
