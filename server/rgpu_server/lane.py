"""The server end of the bulk lane (see rgpu_protocol/lane.py): raw bytes straight into tensors.

After the lane's HTTP upgrade, the websocket protocol object hands the transport over to
`LaneProtocol`, a buffered protocol: the kernel copies an upload's bytes directly into the staging
tensor (`recv_into`), with no framing, unmasking or reassembly in between. Staged uploads wait in
the session's `StagedUploads` until the UPLOAD message that names them runs. Downloads go out from
the session's worker thread through `ServerLane.send`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import torch

from rgpu_protocol import ProtocolError, byte_view
from rgpu_protocol.lane import (
    FROM_CLIENT,
    HEADER_SIZE,
    LaneRecord,
    lane_header,
    parse_lane_header,
)

from . import numerics

log = logging.getLogger("rgpu_server")

SEND_PIECE = 4 << 20  # a download is handed to the transport this much at a time
DEFAULT_STAGE_LIMIT = 16 << 30  # staged, not yet claimed upload bytes per session
MAX_SPARE = 1 << 30  # a claimed staging buffer up to this size is kept for the next upload


class StagedUploads:
    """Upload bytes that arrived on a lane, by ticket, until their UPLOAD message claims them."""

    def __init__(self, limit: int = DEFAULT_STAGE_LIMIT) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._staged: dict[int, torch.Tensor] = {}
        self.nbytes = 0
        # the last buffer the worker finished with: the next upload lands in memory the kernel
        # has already mapped (a fresh 256 MiB costs 65,536 page faults)
        self._spare: torch.Tensor | None = None

    def allocate(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            spare = self._spare
            if spare is not None and nbytes <= spare.numel() <= 2 * nbytes:
                self._spare = None
                return spare[:nbytes]
        return torch.empty(nbytes, dtype=torch.uint8)

    def recycle(self, buffer: torch.Tensor) -> None:
        """The worker is done with a staged buffer (its bytes were copied out)."""
        base = buffer._base if buffer._base is not None else buffer
        if base.numel() <= MAX_SPARE:
            with self._lock:
                self._spare = base

    def admit(self, nbytes: int) -> bool:
        with self._lock:
            return self.nbytes + nbytes <= self.limit

    def put(self, ticket: int, data: torch.Tensor) -> None:
        with self._lock:
            old = self._staged.pop(ticket, None)
            if old is not None:
                self.nbytes -= old.numel()
            self._staged[ticket] = data
            self.nbytes += data.numel()

    def take(self, ticket: int) -> torch.Tensor | None:
        with self._lock:
            data = self._staged.pop(ticket, None)
            if data is not None:
                self.nbytes -= data.numel()
            return data

    def clear(self) -> None:
        with self._lock:
            self._staged.clear()
            self.nbytes = 0
            self._spare = None


class LaneProtocol(asyncio.BufferedProtocol):
    """Reads PUT records into staging tensors; writes ACK and DATA records."""

    def __init__(self, staged: StagedUploads, max_bytes: int, peer: str) -> None:
        self.staged = staged
        self.max_bytes = max_bytes
        self.peer = peer
        self.transport: asyncio.Transport | None = None
        self.closed = asyncio.get_running_loop().create_future()
        self._header = bytearray(HEADER_SIZE)
        self._target = memoryview(self._header)  # what the kernel fills next
        self._got = 0
        self._ticket = 0
        self._staging: torch.Tensor | None = None
        self._drained: asyncio.Future | None = None
        self._sending = False  # a DATA record is going out in pieces
        self._held_acks: list[bytes] = []

    def start(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        # a DATA record's bytes are handed over in pieces, each written out before the next is
        # handed over, so the transport never holds more than a piece (high=0 would pause a TLS
        # transport for good: it compares its empty buffer with >=)
        transport.set_write_buffer_limits(high=1, low=0)
        transport.write(lane_header(LaneRecord.READY, 0, 0))

    # -- reading -------------------------------------------------------------------------------

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._target[self._got :]

    def buffer_updated(self, nbytes: int) -> None:
        self._got += nbytes
        if self._got < len(self._target):
            return
        try:
            if self._staging is None:
                self._start_record()
            else:
                self._finish_record()
        except (ProtocolError, RuntimeError, MemoryError) as e:  # a bad record, or no memory
            log.warning("lane from %s closed: %s", self.peer, e)
            self._staging = None
            self.transport.close()

    def _start_record(self) -> None:
        _, ticket, nbytes = parse_lane_header(self._header, FROM_CLIENT, self.max_bytes)
        if not self.staged.admit(nbytes):
            raise ProtocolError(
                f"an upload of {nbytes} bytes would exceed the {self.staged.limit} bytes this "
                "session may hold staged"
            )
        self._ticket = ticket
        self._staging = self.staged.allocate(nbytes)
        self._got = 0
        if nbytes == 0:
            self._finish_record()
        else:
            self._target = byte_view(self._staging)

    def _finish_record(self) -> None:
        staging, self._staging = self._staging, None
        self.staged.put(self._ticket, staging)
        ack = lane_header(LaneRecord.ACK, self._ticket, staging.numel())
        if self._sending:  # never inside a DATA record's bytes: after it
            self._held_acks.append(ack)
        else:
            self.transport.write(ack)
        self._target = memoryview(self._header)
        self._got = 0

    # -- writing -------------------------------------------------------------------------------

    def pause_writing(self) -> None:
        self._drained = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        self._drained = None

    async def send(self, ticket: int, data: memoryview) -> None:
        if self.transport is None or self.transport.is_closing():
            raise ConnectionError("the lane is closed")
        self._sending = True
        try:
            self.transport.write(lane_header(LaneRecord.DATA, ticket, len(data)))
            for off in range(0, len(data), SEND_PIECE):
                if self.transport.is_closing():
                    raise ConnectionError("the lane closed during a download")
                self.transport.write(data[off : off + SEND_PIECE])
                if self._drained is not None:
                    await self._drained
        finally:
            self._sending = False
            acks, self._held_acks = self._held_acks, []
            if acks and not self.transport.is_closing():
                self.transport.write(b"".join(acks))

    def connection_lost(self, exc: Exception | None) -> None:
        self._staging = None  # a partial upload is dropped; the client sends it again or not
        if self._drained is not None and not self._drained.done():
            self._drained.set_exception(ConnectionError("the lane closed"))
        if not self.closed.done():
            self.closed.set_result(None)


class ServerLane:
    """A session's open lane, as its worker thread sees it."""

    def __init__(self, protocol: LaneProtocol, loop: asyncio.AbstractEventLoop) -> None:
        self.protocol = protocol
        self.loop = loop

    @property
    def open(self) -> bool:
        t = self.protocol.transport
        return t is not None and not t.is_closing()

    def send(self, ticket: int, data: memoryview) -> bool:
        """Send a download's bytes (worker thread; blocks until the kernel has them all). False
        when the lane is gone: the caller sends them over the websocket instead."""
        if not self.open:
            return False
        fut = asyncio.run_coroutine_threadsafe(self.protocol.send(ticket, data), self.loop)
        try:
            with numerics.released():  # a slow client holds up no other session
                fut.result()
        except Exception:
            return False
        return True

    def close(self) -> None:
        t = self.protocol.transport
        if t is not None:
            self.loop.call_soon_threadsafe(t.close)


async def serve_lane(ws: Any, session: Any, peer: str, lanes: set) -> None:
    """Take an upgraded lane connection away from the websocket protocol and run it raw, for
    `session`, until it closes."""
    keepalive = getattr(ws, "keepalive_task", None)
    if keepalive is not None:  # no pings into a raw stream
        keepalive.cancel()
    lane = LaneProtocol(session.staged, session.max_lane_bytes, peer)
    ws.transport.set_protocol(lane)
    lane.start(ws.transport)
    server_lane = ServerLane(lane, asyncio.get_running_loop())
    old = session.lane
    session.lane = server_lane
    if old is not None:
        old.close()
    lanes.add(server_lane)
    log.debug("session %s opened a lane from %s", session.hex, peer)
    try:
        await lane.closed
    finally:
        lanes.discard(server_lane)
        if session.lane is server_lane:
            session.lane = None
        # the websocket object never sees this connection again: tell it the connection is
        # over, so it skips the closing handshake a raw stream cannot carry
        ws.connection_lost(None)
