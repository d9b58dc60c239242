"""UPLOAD and DOWNLOAD: tensor bytes in and out of a session.

An upload arrives inline (small), as CHUNK frames right after its BATCH (written straight into the
destination when its bytes are exactly the upload's), or staged on the bulk lane under a ticket.
A download goes back inline in the REPLY, as DATA frames before it, or on the lane.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rgpu_protocol import (
    Frame,
    ProtocolError,
    Status,
    byte_view,
    chunk_frame,
    lane_reply,
)
from rgpu_protocol.lane import INTERRUPTED_TICKET
from rgpu_protocol.server_stream import chunk_header

from .poison import Poison, describe
from .state import SessionState

INLINE_DOWNLOAD = 1 << 20  # downloads up to this size ride inside the REPLY
DOWNLOAD_CHUNK = 1 << 20

Writer = Callable[[int, memoryview], None]


class ChunkSink:
    """Where the CHUNK frames of a chunked upload go, and what happens when they are all in
    (or the client cancelled the upload). The worker feeds it; see Session._take_chunk."""

    def __init__(self, s: SessionState, dst: Any, dst_id: int | None, write: Writer) -> None:
        self.s = s
        self.dst = dst
        self.dst_id = dst_id
        self.write = write
        self.finish: Callable[[], None] | None = None

    def done(self) -> None:
        if self.finish is not None:
            self.finish()

    def aborted(self) -> None:
        if self.dst_id is not None:
            self.s.tensors[self.dst_id] = _interrupted()


class _Discard:
    """The chunks of an upload applied before (a replay after a resume): nothing to keep."""

    def write(self, offset: int, payload: memoryview) -> None:
        pass

    def done(self) -> None:
        pass

    def aborted(self) -> None:
        pass  # its source changed since; it was applied whole the first time


DISCARD = _Discard()


def upload(s: SessionState, seq: int, msg: list) -> None:
    dst, data = msg[1], msg[2]
    if type(data) is list and len(data) == 3:  # chunked: [dtype, shape, nbytes], CHUNKs follow
        _expect_chunks(s, dst, data)
        return
    staged = None  # a lane buffer, given back once its bytes are copied out
    if type(data) is list and len(data) == 4:  # on the lane: [dtype, shape, nbytes, ticket]
        if data[3] == INTERRUPTED_TICKET:
            _poison_interrupted(s, dst)
            return
        staged = _staged_upload(s, data)
        if staged is None:
            return
        host = staged[1]
    elif isinstance(data, torch.Tensor):
        host = data
    else:
        raise ProtocolError("UPLOAD data must be a host tensor or a chunk header")
    if s.bad is not None:
        if type(s.bad) is not Poison:
            s.fail("upload", s.missing_message(), ())
        return
    _copy_into(s, dst, host)
    if staged is not None and s.device.type in ("cpu", "cuda"):
        # copy_ from pageable memory has read it all when it returns on these devices
        s.staged.recycle(staged[0])


def _copy_into(s: SessionState, dst: Any, host: torch.Tensor) -> None:
    if not isinstance(dst, torch.Tensor):
        raise ProtocolError("UPLOAD destination must be a tensor reference")
    try:
        with torch.no_grad():
            dst.copy_(host)
    except Exception as e:
        s.fail("upload", describe(e), ())


def _expect_chunks(s: SessionState, dst: Any, header: list) -> None:
    """Set up where the chunks that follow go: straight into dst, or into a staging buffer
    copied into dst at the end, or nowhere (no usable destination)."""
    dtype, shape, nbytes = chunk_header(header)
    dst_id = s.refs.get(id(dst)) if isinstance(dst, torch.Tensor) else None
    bad = s.bad
    write = _direct_writer(s, dst, dtype, shape)
    if write is not None:
        s.sink = ChunkSink(s, dst, dst_id, write)
        return
    if bad is not None or not isinstance(dst, torch.Tensor) or nbytes > dst.numel() * 16:
        # no destination (poisoned or unknown id), or more bytes than any copy_ into it could
        # use: take the chunks without keeping them, then report
        sink = ChunkSink(s, None, None, DISCARD.write)

        def report() -> None:
            if bad is None:
                s.fail("upload", f"the upload of {nbytes} bytes does not fit its destination", ())
            elif type(bad) is not Poison:
                s.fail("upload", f"KeyError: no tensor with id {bad} in this session (freed, or "
                       "never created)", ())  # fmt: skip

        sink.finish = report
        s.sink = sink
        return
    # a cast, a broadcast or a strided destination: stage, then copy_
    staging = bytearray(nbytes)
    view = memoryview(staging)

    def write_staging(offset: int, payload: memoryview) -> None:
        view[offset : offset + len(payload)] = payload

    sink = ChunkSink(s, dst, dst_id, write_staging)
    sink.finish = lambda: _copy_into(
        s, dst, torch.frombuffer(staging, dtype=dtype).reshape(shape) if nbytes
        else torch.empty(shape, dtype=dtype)
    )  # fmt: skip
    s.sink = sink


def _interrupted() -> Poison:
    return Poison("upload", "the upload was interrupted on the client; this tensor holds no data")


def _poison_interrupted(s: SessionState, dst: Any) -> None:
    if isinstance(dst, torch.Tensor) and id(dst) in s.refs:
        s.tensors[s.refs[id(dst)]] = _interrupted()


def _staged_upload(s: SessionState, header: list) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(buffer, host tensor) of an upload staged on the lane; None (the upload failed) if it
    is not there."""
    ticket = header[3]
    dtype, shape, nbytes = chunk_header(header[:3])
    if type(ticket) is not int:
        raise ProtocolError("a lane UPLOAD's ticket must be an integer")
    staged = s.staged.take(ticket)
    if staged is None or staged.numel() != nbytes:
        s.fail("upload", f"no {nbytes} bytes were staged on the lane as upload {ticket}", ())
        return None
    s.lane_transfers += 1
    host = staged.view(dtype).reshape(shape) if nbytes else torch.empty(shape, dtype=dtype)
    return staged, host


def _direct_writer(s: SessionState, dst: Any, dtype: torch.dtype, shape: list) -> Writer | None:
    """Write chunks straight into dst when its bytes are exactly the upload's bytes (saves a
    staging buffer the size of the upload and a full copy)."""
    if (
        s.bad is not None
        or not isinstance(dst, torch.Tensor)
        or dst.dtype != dtype
        or list(dst.shape) != shape
        or not dst.is_contiguous()
        or dst.is_conj()
        or dst.is_neg()
        or dst.numel() == 0
    ):
        return None
    if dst.device.type == "cpu":
        view = byte_view(dst)

        def write(offset: int, payload: memoryview) -> None:
            view[offset : offset + len(payload)] = payload

        return write
    flat = dst.reshape(-1).view(torch.uint8)
    if s.pinned is None or s.pinned.numel() < s.limits.max_chunk:
        pin = s.device.type == "cuda"
        s.pinned = torch.empty(s.limits.max_chunk, dtype=torch.uint8, pin_memory=pin)
    pinned = s.pinned
    pinned_view = byte_view(pinned)

    def write_device(offset: int, payload: memoryview) -> None:
        n = len(payload)
        pinned_view[:n] = payload
        flat[offset : offset + n].copy_(pinned[:n])

    return write_device


def download(s: SessionState, seq: int, msg: list) -> None:
    ticket = msg[2] if len(msg) == 3 else None
    if s.error_pending(seq):
        return
    t = msg[1]
    if s.bad is not None:
        if type(s.bad) is Poison:
            s.reply(seq, Status.ERROR, s.bad_reply("download"))
        else:
            s.reply(seq, Status.ERROR, [f"download of tensor {s.bad}",
                                        f"KeyError: no tensor with id {s.bad} in this session"])  # fmt: skip
        return
    if not isinstance(t, torch.Tensor):
        raise ProtocolError("DOWNLOAD takes a tensor reference")
    try:
        data = _host_bytes(t)
    except Exception as e:
        s.reply(seq, Status.ERROR, ["download", describe(e)])
        return
    n = len(data)
    if n <= INLINE_DOWNLOAD:
        s.reply(seq, Status.OK, bytes(data))
        return
    lane = s.lane
    if ticket is not None and lane is not None and lane.send(ticket, data):
        s.lane_transfers += 1
        s.reply(seq, Status.OK, lane_reply(n))  # a lost lane: the client asks again
        return
    frames = [
        chunk_frame(Frame.DATA, seq, off, data[off : off + DOWNLOAD_CHUNK])
        for off in range(0, n, DOWNLOAD_CHUNK)
    ]
    s.reply(seq, Status.OK, n, frames)


def _host_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a tensor as contiguous CPU memory (conj/neg resolved)."""
    t = t.detach().resolve_conj().resolve_neg()
    if t.device.type != "cpu":
        t = t.cpu()
    return byte_view(t.contiguous())
