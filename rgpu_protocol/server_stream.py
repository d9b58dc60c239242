"""The server's end of the op stream as a state machine: no sockets, threads or clocks inside.

`ServerStream` knows which message comes next, tells a message to run from one a resumed client
sent again (whose reply it resends from a small cache, or whose chunks must be drained), checks
the CHUNK frames of an upload, keeps replies for resending, and decides when to confirm progress
with an ACK frame. The I/O layer (`rgpu_server.session`) feeds it frames from the connection, runs
what it yields, and sends the frames it returns.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch

from .codec import DEFAULT_LIMITS, Encoder, Limits, default_ext_hook
from .errors import ProtocolError
from .frames import (
    ABORT_OFFSET,
    BatchReader,
    Frame,
    ack_frame,
    decompress_batch,
    parse_chunk,
    reply_frame,
)
from .messages import CANCELLABLE, WAITED, Kind, MessageSpec, Status, check_message

REPLY_CACHE = 32  # replies kept for resending after a dropped connection...
REPLY_CACHE_BYTES = 512 << 20  # ...and their bytes (the newest is always kept)
ACK_EVERY_MESSAGES = 2048
ACK_EVERY_BYTES = 4 << 20
ACK_IDLE_BYTES = 16 << 10


class Action(enum.Enum):
    RUN = "run"  # a new message: run it (a chunked UPLOAD: its chunks follow)
    CANCEL = "cancel"  # a new message an interrupt cancelled before it ran: poison, do not run
    RESEND = "resend"  # a waited message applied before: send `frames` (its reply) again
    DRAIN = "drain"  # a chunked UPLOAD applied before: its `nbytes` of chunks follow, unneeded
    SKIP = "skip"  # applied before, nothing to answer


class Incoming(NamedTuple):
    seq: int
    spec: MessageSpec | None  # a message to run: its kind's spec, which it was checked against
    msg: list
    action: Action
    frames: list | None = None  # RESEND
    nbytes: int = 0  # a chunked UPLOAD's bytes


_RUN = Action.RUN
_UPLOAD = int(Kind.UPLOAD)


class UploadAborted(Exception):
    """The client cancelled a chunked upload midway (Ctrl-C); its destination is poisoned."""


def chunk_header(header: Any) -> tuple[torch.dtype, list, int]:
    """(dtype, shape, nbytes) of a chunked UPLOAD's `[dtype, shape, nbytes]`; nbytes must be
    exactly what the shape and dtype take."""
    if type(header) is not list or len(header) != 3:
        raise ProtocolError("chunked UPLOAD header is [dtype, shape, nbytes]")
    dtype, shape, nbytes = header
    if type(dtype) is not torch.dtype or type(shape) is not list or type(nbytes) is not int:
        raise ProtocolError("chunked UPLOAD header has the wrong types")
    numel = 1
    for s in shape:
        if type(s) is not int or s < 0:
            raise ProtocolError("chunked UPLOAD shape must be non-negative integers")
        numel *= s
    if nbytes != numel * dtype.itemsize:
        raise ProtocolError(f"chunked UPLOAD announces {nbytes} bytes for shape {shape} of {dtype}")
    return dtype, shape, nbytes


def is_chunked_upload(msg: list) -> bool:
    return msg[0] == Kind.UPLOAD and len(msg) == 3 and type(msg[2]) is list and len(msg[2]) == 3


class ServerStream:
    def __init__(
        self,
        limits: Limits = DEFAULT_LIMITS,
        encode: Callable[[Any], bytes] | None = None,
    ) -> None:
        self.limits = limits
        self._encode = encode or Encoder().encode
        self.last_seq = 0  # the last message applied
        self.cancel_upto = 0  # new messages up to this one are cancelled, not run (`cancel`)
        self.decoding = 0  # the message being decoded now
        self.received = 0  # bytes of batch and chunk frames fed in
        self._replies: collections.OrderedDict[int, list] = collections.OrderedDict()
        self._reply_bytes = 0
        self._acked = 0  # last sequence number announced in an ACK frame
        self._acked_bytes = 0
        # the chunked upload in progress: [seq, nbytes, received, fresh (not a replay)]
        self._upload: list | None = None

    # -- batches --------------------------------------------------------------------------------

    def messages(
        self, frame: bytes, ext_hook: Callable[[int, bytes], Any] = default_ext_hook
    ) -> Iterator[Incoming | tuple]:
        """The messages of a BATCH or BATCH_Z frame as `Incoming` fields (a plain tuple of them
        for a message to run, the common case), decoded one at a time (message i only after
        message i - 1 ran: references resolve against the tensors it made), each with what to
        do with it. Messages to run are checked against their kind's spec first
        (`check_message`). A message to RUN counts as applied once the caller asks for the next one;
        if the caller stops early, it was not. A chunked UPLOAD must end its batch; it counts
        as applied once its last CHUNK came in (`chunk`), and a RUN or DRAIN of one means the
        next frames are its chunks."""
        if self._upload is not None:
            raise ProtocolError("UPLOAD expected a CHUNK frame next")
        self.received += len(frame)
        kind = frame[0] if frame else -1
        if kind == Frame.BATCH_Z:
            frame = decompress_batch(frame, self.limits)
        elif kind != Frame.BATCH:
            if kind == Frame.CHUNK:
                self._stray_chunk(frame)
                return
            raise ProtocolError(
                "empty frame" if kind == -1 else f"a client may not send frame kind {kind}"
            )
        reader = BatchReader(frame, self.limits, ext_hook)
        seq = reader.first_seq
        if seq > self.last_seq + 1:
            raise ProtocolError(f"sequence gap: expected {self.last_seq + 1}, got {seq}")
        next_message = reader.next_message
        while True:
            self.decoding = seq  # references resolve while message `seq` is decoded
            msg = next_message()
            if msg is None:
                break
            if self._upload is not None:
                raise ProtocolError("a chunked UPLOAD must be the last message of its batch")
            if seq > self.last_seq and (msg[0] != _UPLOAD or not is_chunked_upload(msg)):
                spec = check_message(msg)
                if seq <= self.cancel_upto and msg[0] in CANCELLABLE:
                    yield (seq, spec, msg, Action.CANCEL, None, 0)
                else:
                    yield (seq, spec, msg, _RUN, None, 0)  # the hot path: a plain tuple
                self.last_seq = seq
            elif is_chunked_upload(msg):
                spec = check_message(msg)
                nbytes = chunk_header(msg[2])[2]
                fresh = seq > self.last_seq
                if nbytes:
                    self._upload = [seq, nbytes, 0, fresh]
                action = Action.RUN if fresh else Action.DRAIN
                yield Incoming(seq, spec, msg, action, nbytes=nbytes)
                if fresh and not nbytes:  # no chunks follow
                    self.last_seq = seq
            elif msg[0] in WAITED:
                yield Incoming(seq, None, msg, Action.RESEND, frames=self._cached_reply(seq))
            else:
                yield Incoming(seq, None, msg, Action.SKIP)
            seq += 1

    def cancel(self, upto: int) -> None:
        """An interrupt on the client: the work of messages up to `upto` that has not started is
        cancelled (Action.CANCEL). Safe to call from another thread than the one iterating."""
        if upto > self.cancel_upto:
            self.cancel_upto = upto

    def _stray_chunk(self, frame: bytes) -> None:
        seq, offset, _ = parse_chunk(frame, self.limits)
        if offset == ABORT_OFFSET and seq <= self.last_seq:
            return  # the cancelled upload had already arrived whole; nothing to undo
        raise ProtocolError("a CHUNK frame arrived that no UPLOAD announced")

    # -- chunked uploads -------------------------------------------------------------------------

    @property
    def chunks_wanted(self) -> bool:
        """The next frame must be a CHUNK of the upload in progress."""
        return self._upload is not None

    def chunk(self, frame: bytes) -> tuple[int, memoryview, bool]:
        """(offset, payload, last) of the next CHUNK of the upload in progress; with the last
        one, a new upload counts as applied. UploadAborted when the client cancelled it;
        ProtocolError for anything else."""
        u = self._upload
        if u is None:
            raise ProtocolError("a CHUNK frame arrived that no UPLOAD announced")
        self.received += len(frame)
        if not frame or frame[0] != Frame.CHUNK:
            raise ProtocolError("UPLOAD expected a CHUNK frame next")
        seq, offset, payload = parse_chunk(frame, self.limits)
        if offset == ABORT_OFFSET and seq == u[0]:
            self._upload = None
            if u[3]:
                self.last_seq = seq  # applied as "interrupted": its destination is poisoned
            raise UploadAborted()
        if seq != u[0] or offset != u[2] or u[2] + len(payload) > u[1] or not payload:
            raise ProtocolError(
                f"CHUNK for seq {seq} at offset {offset} does not continue UPLOAD {u[0]}"
            )
        u[2] += len(payload)
        last = u[2] == u[1]
        if last:
            self._upload = None
            if u[3]:
                self.last_seq = seq
        return offset, payload, last

    def abandon_chunks(self) -> None:
        """The connection dropped mid-upload: the client sends the upload again, whole."""
        self._upload = None

    # -- replies --------------------------------------------------------------------------------

    def reply(self, seq: int, status: Status, value: Any, data: list | None = None) -> list:
        """The frames that answer waited message `seq` (DATA frames first, then the REPLY);
        kept for resending after a dropped connection. Seq 0: about the stream as a whole."""
        frames = [*(data or ()), reply_frame(self._encode, seq, status, value)]
        if seq:
            self._remember(seq, frames)
        return frames

    def _remember(self, seq: int, frames: list) -> None:
        self._replies[seq] = frames
        self._reply_bytes += _size(frames)
        while len(self._replies) > 1 and (
            len(self._replies) > REPLY_CACHE or self._reply_bytes > REPLY_CACHE_BYTES
        ):
            _, old = self._replies.popitem(last=False)
            self._reply_bytes -= _size(old)

    def _cached_reply(self, seq: int) -> list:
        frames = self._replies.get(seq)
        if frames is None:
            frames = [reply_frame(self._encode, seq, Status.ERROR, [
                "resume", "the reply to this request was lost with the connection and is no longer "
                "kept; run the request again"])]  # fmt: skip
        return frames

    def forget_replies(self) -> None:
        self._replies.clear()
        self._reply_bytes = 0

    # -- confirming progress --------------------------------------------------------------------

    def ack_due(self, idle: bool) -> bytes | None:
        """An ACK frame when the client should hear what was applied: caught up (`idle`: nothing
        else received is waiting), or every so many messages or bytes, so its replay buffer stays
        small and flow control never stalls it."""
        if self.last_seq > self._acked and (
            (idle and self.received - self._acked_bytes >= ACK_IDLE_BYTES)
            or self.last_seq - self._acked >= ACK_EVERY_MESSAGES
            or self.received - self._acked_bytes >= ACK_EVERY_BYTES
        ):
            self._acked = self.last_seq
            self._acked_bytes = self.received
            return ack_frame(self.last_seq)
        return None


def _size(frames: list) -> int:
    return sum(len(f) if not isinstance(f, list) else sum(len(x) for x in f) for f in frames)
