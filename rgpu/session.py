"""A session with one server: the op queue, batching, waits, transfers and the counters.

Ops are encoded the moment they are issued (so a bad argument fails on the user's line) and kept
in a queue. The queue goes out as one BATCH frame when an answer is needed (a wait), when it holds
`flush_ops` messages or `flush_bytes` bytes, or when the client has been quiet for `quiet_s`, so
the server computes while the client is still issuing ops.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from . import dedup
from .connection import Connection, split_token, ssl_context
from .errors import (
    AuthError,
    ConnectionLost,
    ProtocolViolation,
    RemoteError,
    RgpuError,
    SessionLost,
)
from .lane import Lane, LaneError
from .progress import TransferProgress
from .protocol import (
    DEFAULT_LIMITS,
    CloseCode,
    EncodeError,
    Encoder,
    Frame,
    Kind,
    ProtocolError,
    Status,
    batch_frame,
    byte_view,
    chunk_frame,
    compress_batch,
    default,
    host_ext,
    parse_ack,
    parse_chunk,
    parse_reply,
)
from .protocol.lane import INTERRUPTED_TICKET
from .replay import ChunkedUpload, ReplayBuffer
from .tensor import RemoteTensor
from .writer import FrameWriter

log = logging.getLogger("rgpu")

_RUN = int(Kind.RUN)
INLINE_UPLOAD = 256 * 1024  # uploads up to this size ride inside the op stream
UPLOAD_CHUNK = 1 << 20  # small enough that an interrupted upload stops within one chunk
ABORT_OFFSET = (1 << 64) - 1  # a CHUNK at this offset cancels the upload it belongs to
FREE_BYTES = 1 << 20  # freed tensors holding this much go to the server before the next op...
FREE_COUNT = 1024  # ...and so do this many; otherwise frees ride along with the next wait


COMPRESS_MIN_BYTES = 256  # smaller batches gain too little to be worth compressing
SLOW_LINK_RTT_S = 0.010  # a link with a longer round trip is a WAN: compress batches...
SLOW_LINK_BPS = 50e6  # ...and so is one measured below 400 Mbit/s
LINK_PROBE_BYTES = 1 << 20  # downloads this large measure the link's throughput
LANE_BYTES_PER_RTT = 1e9  # a lane transfer waits one extra round trip: worth it past 1 GB/s x RTT
LANE_RETRY_S = 30.0  # after a lane fails to open, transfers use the websocket this long
LANE_HASH_BELOW_BPS = 500e6  # lane uploads are hashed for dedup when the lane is slower than this


def _compress_mode() -> str:
    """RGPU_COMPRESS: "auto" (the default: when the link is measured slow), "on" or "off"."""
    raw = os.environ.get("RGPU_COMPRESS", "auto").strip().lower()
    if raw in ("", "auto"):
        return "auto"
    if raw in ("1", "on", "yes", "true", "always"):
        return "on"
    if raw in ("0", "off", "no", "false", "never"):
        return "off"
    raise RgpuError(
        f"RGPU_COMPRESS={raw!r} is not understood: use auto (compress the op stream when the link "
        "is measured slow), 1 (always) or 0 (never)"
    )


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def _encode_hook(obj: Any) -> Any:
    """Client-side msgpack conversions: RemoteTensor -> ref, CPU tensor -> inline host data."""
    if type(obj) is RemoteTensor:
        return obj._r.ext
    if isinstance(obj, torch.Tensor):
        if obj.device.type != "cpu":
            raise EncodeError(
                f"cannot mix a {obj.device.type} tensor with rgpu tensors; move it to rgpu first"
            )
        t = obj.detach().resolve_conj().resolve_neg().contiguous()
        if t.numel() == 0:
            return host_ext(t.dtype, tuple(t.shape), b"")
        return host_ext(t.dtype, tuple(t.shape), byte_view(t))
    if isinstance(obj, torch.Generator):
        raise EncodeError(
            "rgpu ops cannot take a torch.Generator: the server keeps one generator per session. "
            "Seed it with torch.manual_seed(...) or torch.rgpu.manual_seed(...)."
        )
    return default(obj)


class Waiter:
    """One waited message: the reply, and where DATA frames for it go."""

    __slots__ = (
        "event",
        "status",
        "value",
        "sink",
        "received",
        "on_abandoned",
        "on_done",
        "seq",
        "done_at",
    )

    def __init__(self, sink: Callable[[int, memoryview], None] | None = None) -> None:
        self.event = threading.Event()
        self.status: Status | None = None
        self.value: Any = None
        self.sink = sink
        self.received = 0  # DATA bytes routed to the sink so far
        self.on_abandoned: Callable[[Status, Any], None] | None = None  # a reply nobody waits for
        self.on_done: Callable[[Waiter], None] | None = None  # runs on the reader thread
        self.seq = 0
        self.done_at = 0.0

    def finish(self, status: Status, value: Any) -> None:
        self.status = status
        self.value = value
        self.done_at = time.perf_counter()
        if self.on_done is not None:
            self.on_done(self)
        self.event.set()


class Session:
    """One client session with one server: it survives dropped connections by resuming."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        open_timeout: float = 10.0,
        local_process: Any = None,
        transport: Any = None,
    ) -> None:
        """`transport`, when given, carries the connection (an SSH tunnel): before every
        reconnect, `transport.ensure()` re-opens it if it died and returns the URL to use; the
        session calls `transport.stop()` when it ends."""
        self.transport = transport
        url, url_token = split_token(url)
        self.url = url
        self._token = token or url_token
        self._open_timeout = open_timeout
        self.lock = threading.RLock()
        self.frees: collections.deque[int] = collections.deque()
        self.free_bytes = 0  # storage bytes behind `frees`
        self.flush_ops = _env_int("RGPU_FLUSH_OPS", 128)
        self.flush_bytes = _env_int("RGPU_FLUSH_BYTES", 1 << 20)
        self.quiet_s = _env_int("RGPU_QUIET_US", 2000) / 1e6
        self.reconnect_s = float(os.environ.get("RGPU_RECONNECT_SECONDS", 60))
        self.check_meta = os.environ.get("RGPU_CHECK_META", "") not in ("", "0")
        # counters (see rgpu.stats)
        self.messages = 0
        self.waits = 0
        self.bytes_out = 0
        self.bytes_in = 0
        self.frames = 0
        self.wait_seconds = 0.0
        self.reconnects = 0
        self.async_readbacks = 0  # non-blocking copies to the CPU (they need no wait)
        # op-stream compression (tensor bytes are never compressed: floats barely shrink)
        self.compress_mode = _compress_mode()
        self.compressed_frames = 0
        self.compression_saved = 0  # bytes the compressed batches did not put on the wire
        self.link_rtt_s = 0.0  # measured: the handshake, then every ping
        self.link_bps: float | None = None  # measured: the last download of a megabyte or more
        # the bulk lane (rgpu/lane.py): large transfers as raw bytes on a second connection
        self.lane_enabled = os.environ.get("RGPU_LANE", "1") not in ("0", "")
        self.lane_min_bytes = _env_int("RGPU_LANE_MIN_BYTES", 4 << 20)
        self.lane_transfers = 0
        self.lane_bps = float("inf")  # measured by each lane upload
        self._lane: Lane | None = None
        self._lane_lock = threading.Lock()
        self._lane_retry_at = 0.0
        self._tickets = itertools.count(1)
        # The queue: messages _first_seq, _first_seq + 1, ... not yet handed to the writer. A
        # message's sequence number is its position, never a separate counter, so an interrupt
        # between two statements cannot make numbers and messages disagree.
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._pending_data_bytes = 0  # inline upload bytes in the queue (they do not compress)
        self._first_seq = 1
        self._replay = ReplayBuffer(_env_int("RGPU_REPLAY_BYTES", 256 << 20))
        self._waiters: dict[int, Waiter] = {}
        self._abandoned: dict[int, Waiter] = {}
        # waited messages without a reply yet: sent again after a reconnect even if the server
        # applied them, so it resends a reply the dropped connection swallowed
        self._unanswered: dict[int, bytes] = {}
        self._async_error: BaseException | None = None  # from a non-blocking readback
        self._broken: BaseException | None = None
        self._reconnecting = False
        self._state_lock = threading.Lock()
        self.closed = False
        self.local_process = local_process
        self._encode = Encoder(_encode_hook).encode
        self._quiet_kick = threading.Event()
        self._allow_mismatch = os.environ.get("RGPU_ALLOW_VERSION_MISMATCH", "") not in ("", "0")
        self.conn = self._open(None)
        welcome = self.conn.welcome
        self._session_bytes: bytes = bytes(welcome.get("session", b""))
        self.session_id: str = self._session_bytes.hex()
        self.server_torch: str = str(welcome.get("torch", "?"))
        self.server_version: str = str(welcome.get("server", "?"))
        self.device: str = str(welcome.get("device", "?"))
        self.device_name: str = str(welcome.get("device_name", "?"))
        self.max_chunk = min(int(welcome.get("max_chunk", UPLOAD_CHUNK)), UPLOAD_CHUNK)
        self.max_message = int(welcome.get("max_message", DEFAULT_LIMITS.max_message))
        lane_info = welcome.get("lane")
        self._lane_info: dict | None = lane_info if isinstance(lane_info, dict) else None
        self.flush_bytes = min(self.flush_bytes, self.max_message // 2)
        self._writer = self._new_writer(self.conn)
        self.graphs: set[str] = set()  # compiled graphs this session already sent (by content key)
        # what the server holds, by content, for dedup
        self.uploads = dedup.UploadIndex(
            enabled=os.environ.get("RGPU_DEDUP", "1") not in ("0", ""),
            min_bytes=_env_int("RGPU_DEDUP_MIN_BYTES", 4096),
        )
        self._quiet = threading.Thread(
            target=self._quiet_loop, name="rgpu-quiet-flush", daemon=True
        )
        self._quiet.start()

    def _open(self, resume: bytes | None) -> Connection:
        mine: list[Connection] = []

        def on_close(exc: BaseException) -> None:  # only the current connection's loss matters
            if mine and mine[0] is self.conn:
                self._connection_lost(exc)

        conn = Connection(
            self.url,
            token=self._token,
            on_frame=self._on_frame,
            on_close=on_close,
            open_timeout=self._open_timeout,
            allow_version_mismatch=self._allow_mismatch,
            resume=resume,
        )
        mine.append(conn)
        self.link_rtt_s = self._measure_rtt(conn)
        self._server_zlib = "zlib" in (conn.welcome.get("compress") or ())
        return conn

    @staticmethod
    def _measure_rtt(conn: Connection) -> float:
        """The link's round trip: the lower of the handshake's and one websocket ping's (the
        handshake alone also counts the server setting up the session)."""
        rtt = conn.handshake_rtt_s
        t0 = time.perf_counter()
        try:
            if conn.ws.ping().wait(min(5.0, 10 * rtt + 0.1)):
                rtt = min(rtt, time.perf_counter() - t0)
        except Exception:  # the link dropped already: the reconnect logic takes it from here
            pass
        return rtt

    def _new_writer(self, conn: Connection) -> FrameWriter:
        def failed(exc: BaseException) -> None:
            if self.conn is conn:
                self._connection_lost(exc)

        return FrameWriter(conn.send, failed, self._wire_form)

    @property
    def compressing(self) -> bool:
        """Whether batches go out compressed now: when asked (RGPU_COMPRESS=1) or, by default,
        when the link is measured slow (a long round trip or a low throughput); the op stream
        shrinks several-fold, so that is where compressing pays."""
        if not self._server_zlib or self.compress_mode == "off":
            return False
        if self.compress_mode == "on":
            return True
        bps = self.link_bps
        return self.link_rtt_s >= SLOW_LINK_RTT_S or (bps is not None and bps < SLOW_LINK_BPS)

    def _wire_form(self, frame: bytes | list) -> bytes | list:
        """The form a compressible frame goes out in (on the writer thread): a batch compressed
        when that pays."""
        if (
            type(frame) is not bytes
            or len(frame) < COMPRESS_MIN_BYTES
            or frame[0] != Frame.BATCH
            or not self.compressing
        ):
            return frame
        packed = compress_batch(frame)
        if packed is None:
            return frame
        self.compressed_frames += 1
        self.compression_saved += len(frame) - len(packed)
        return packed

    # -- the queue ---------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._broken is not None:
            if isinstance(self._broken, RgpuError):
                raise self._broken
            raise ConnectionLost(
                f"the connection to the rgpu server at {self.url} is lost ({self._broken}); "
                "its tensors are unreachable. Call rgpu.connect() to start a new session."
            )
        if self.closed:
            raise RgpuError(
                "this rgpu session was disconnected; its tensors are gone. Call rgpu.connect()."
            )

    def _too_big(self, data: bytes) -> None:
        if len(data) > self.max_message - 64:
            raise EncodeError(
                f"this op encodes to {len(data)} bytes, over the server's {self.max_message}-byte "
                "message limit; move large CPU tensors to rgpu first (x.to('rgpu')) instead of "
                "passing them as arguments"
            )
        if self._pending_bytes + len(data) > self.max_message - 64:
            self._flush_locked()

    def _append_locked(self, msg: tuple) -> int:
        data = self._encode(msg)
        if len(data) > 65536:
            self._too_big(data)
        pending = self._pending
        pending.append(data)
        self._pending_bytes += len(data)
        self.bytes_out += len(data)
        self.messages += 1
        return self._first_seq + len(pending) - 1

    def post(self, msg: tuple) -> None:
        """Queue a message that needs no answer."""
        flow = False
        if self.uploads._unsettled:  # before this op can change a tensor an upload went into
            self.uploads.settle()
        with self.lock:
            if self._broken is not None or self.closed:
                self._check_usable()
            if self.free_bytes >= FREE_BYTES or len(self.frees) >= FREE_COUNT:
                self._drain_frees_locked()  # big or many: let the server reuse that memory now
            data = self._encode(msg)
            n = len(data)
            if n > 65536:
                self._too_big(data)
            pending = self._pending
            pending.append(data)
            self._pending_bytes += n
            self.bytes_out += n
            self.messages += 1
            if len(pending) >= self.flush_ops or self._pending_bytes >= self.flush_bytes:
                self._flush_locked()
                if self._replay.bytes > self._replay.limit:
                    flow = True
            elif len(pending) == 1:
                self._quiet_kick.set()
        if flow:
            self._wait_for_acks()

    def flush(self) -> None:
        """Send everything queued, frees included (no wait). Jupyter calls it between cells."""
        with self.lock:
            if self._pending or self.frees:
                self._check_usable()
                self._drain_frees_locked()
                self._flush_locked()

    def _drain_frees_locked(self) -> None:
        """Turn the ids of garbage-collected tensors into one FREE message."""
        frees = self.frees
        if frees:
            ids = []
            try:
                while True:
                    ids.append(frees.popleft())
            except IndexError:
                pass
            self.free_bytes = 0
            self._append_locked((Kind.FREE, ids))

    def _flush_locked(self, upload: ChunkedUpload | None = None) -> None:
        """Send the queue. With `upload`, the queue ends with that UPLOAD message and its chunks
        follow the batch. Frees are not drained here but at op boundaries (waits, `flush`, or
        when they pile up), so the message count does not depend on when flushes happen."""
        pending = self._pending
        if not pending:
            return
        first = self._first_seq
        # kept for replay first, then sent: a connection can drop at any moment after this
        self._replay.add(first, pending, self._pending_bytes, upload)
        # a batch that is mostly tensor bytes (inline uploads) would barely shrink
        compressible = 2 * self._pending_data_bytes < self._pending_bytes
        self._send(batch_frame(first, pending), compressible=compressible)
        self._pending_data_bytes = 0
        # only now forget the messages: if an interrupt lands before this line, they go out again
        # with the same numbers, and the server drops what it already applied
        self._first_seq = first + len(pending)
        self._pending = []
        self._pending_bytes = 0

    def _wait_for_acks(self) -> None:
        """Flow control: the server is far behind; let it catch up before queueing more.
        Called without the lock held, so a reconnect can replay meanwhile."""
        while not self._replay.wait_below_limit(0.1):
            self._check_usable()

    def _send(self, frame: bytes | list, tag: object = None, compressible: bool = False) -> int:
        """Hand a frame to the writer thread; returns its ticket (0 while reconnecting: the
        replay after the reconnect sends it). A `compressible` frame holds no tensor bytes."""
        self._check_usable()
        if self._reconnecting:
            return 0
        nbytes = len(frame) if type(frame) is bytes else sum(len(b) for b in frame)
        ticket = self._writer.queue(frame, nbytes, tag, compressible)
        self.frames += 1
        return ticket

    def kick(self) -> None:
        """Wake the quiet-flush thread (something is waiting to be sent)."""
        self._quiet_kick.set()

    def _quiet_loop(self) -> None:
        """Send a queue the client stopped adding to, so the server is never idle for nothing."""
        while not self.closed:
            self._quiet_kick.wait()
            self._quiet_kick.clear()
            if self.closed:
                return
            last = -1
            interval = self.quiet_s
            while True:
                time.sleep(interval)
                now = self.messages
                if now == last:
                    break
                if last != -1:
                    # still streaming (its batches go out by count): look less often, since
                    # every wake-up takes the GIL from the thread issuing ops
                    interval = min(interval * 2, 4 * self.quiet_s)
                last = now
            with self.lock:
                if self._pending and self._broken is None and not self.closed:
                    try:
                        self._flush_locked()
                    except RgpuError:
                        pass

    # -- waits -------------------------------------------------------------------------------

    def request(
        self,
        msg: tuple,
        sink: Callable[[int, memoryview], None] | None = None,
        *,
        on_abandoned: Callable[[Status, Any], None] | None = None,
        progress: TransferProgress | None = None,
    ) -> Any:
        """Queue a waited message, send everything, and block until its reply.

        Ctrl-C returns at once; the reply, when it comes, goes to `on_abandoned` (so, e.g., the
        outputs of an abandoned data-dependent op get freed) and the session stays usable.
        """
        self.check_async_error()
        waiter = self.request_async(msg, sink)
        waiter.on_abandoned = on_abandoned
        return self.wait_for(waiter, progress)

    def request_async(
        self,
        msg: tuple,
        sink: Callable[[int, memoryview], None] | None = None,
        *,
        on_done: Callable[[Waiter], None] | None = None,
        detached: bool = False,
    ) -> Waiter:
        """Queue a waited message and send everything, without waiting: the reply fills the
        returned Waiter (non-blocking readback, events).

        `on_done` runs on the reader thread as the reply lands. A `detached` waiter is one that
        nobody may ever wait for: a lost connection does not wake it, its reply is still routed.
        """
        waiter = Waiter(sink)
        waiter.on_done = on_done
        if self.uploads._unsettled:
            self.uploads.settle()
        with self.lock:
            self._check_usable()
            self._drain_frees_locked()  # so a waited INFO sees memory the client already let go
            seq = self._append_locked(msg)
            waiter.seq = seq
            (self._abandoned if detached else self._waiters)[seq] = waiter
            self._unanswered[seq] = self._pending[-1]
            self._flush_locked()
        return waiter

    def wait_for(self, waiter: Waiter, progress: TransferProgress | None = None) -> Any:
        """Block until `waiter` has its reply (one wait, unless it is already there)."""
        if not waiter.event.is_set():
            self.waits += 1
            t0 = time.perf_counter()
            try:
                self._wait(waiter.seq, waiter, progress)
            finally:
                self.wait_seconds += time.perf_counter() - t0
        status = waiter.status
        if status is Status.OK:
            return waiter.value
        if status is Status.ERROR:
            if getattr(self._async_error, "rgpu_seq", None) == waiter.seq:
                self._async_error = None  # reported here, not again at the next wait
            op, message = waiter.value
            raise RemoteError(str(op), str(message))
        if status is None:  # woken by a lost connection
            self._check_usable()
        raise ProtocolViolation(f"the rgpu server could not understand this client: {waiter.value}")

    def synchronize(self) -> None:
        """Wait until the server has run everything sent so far (one wait); raise a failure of
        a non-blocking readback sent before, which has landed by then (replies come in order)."""
        self.request((Kind.SYNC,))
        self.check_async_error()

    def check_async_error(self) -> None:
        """A non-blocking readback that failed reports at the next wait, once (as CUDA does)."""
        if self._async_error is not None:
            error, self._async_error = self._async_error, None
            raise error

    def _wait(self, seq: int, waiter: Waiter, progress: TransferProgress | None) -> None:
        try:
            while not waiter.event.wait(0.1):
                if self._broken is not None:
                    self._waiters.pop(seq, None)
                    self._check_usable()
                if progress is not None:
                    progress.update_to(waiter.received)
        except BaseException:  # KeyboardInterrupt: stop waiting, keep the session consistent
            with self.lock:
                if self._waiters.pop(seq, None) is not None:
                    self._abandoned[seq] = waiter
            raise
        finally:
            if progress is not None:
                progress.close()

    def _on_frame(self, frame: bytes) -> None:
        """Reader thread: route one server frame."""
        kind = frame[0] if frame else -1
        if kind != Frame.ACK:
            self.bytes_in += len(frame)
        if kind == Frame.REPLY:
            seq, status, value = parse_reply(frame)
            if status is Status.PROTOCOL and seq == 0:
                self._mark_broken(
                    ProtocolViolation(f"the server reported a protocol error: {value}")
                )
                return
            self._replay.ack(seq)  # the server runs messages in order: all before seq are applied
            self._unanswered.pop(seq, None)
            waiter = self._waiters.pop(seq, None)
            if waiter is not None:
                waiter.finish(status, value)
                return
            with self.lock:
                waiter = self._abandoned.pop(seq, None)
            if waiter is None:
                return
            if waiter.on_done is not None:  # a non-blocking readback or an event
                waiter.finish(status, value)
            elif waiter.on_abandoned is not None:
                waiter.on_abandoned(status, value)
        elif kind == Frame.DATA:
            seq, offset, payload = parse_chunk(frame)
            waiter = self._waiters.get(seq) or self._abandoned.get(seq)
            if waiter is not None and waiter.sink is not None:
                waiter.sink(offset, payload)
                waiter.received += len(payload)
        elif kind == Frame.ACK:
            self._replay.ack(parse_ack(frame))
        else:
            raise ProtocolError(f"unexpected frame kind {kind} from the server")

    # -- a dropped connection ----------------------------------------------------------------

    def _connection_lost(self, exc: BaseException) -> None:
        if self.closed or self._broken is not None:
            return
        code = getattr(getattr(exc, "rcvd", None), "code", None)
        if code == CloseCode.GOING_AWAY:
            self._mark_broken(ConnectionLost(
                f"the rgpu server at {self.url} shut down; this session and its tensors are gone. "
                "Call rgpu.connect() once a server runs again."))  # fmt: skip
            return
        if code == CloseCode.PROTOCOL_ERROR:
            self._mark_broken(ProtocolViolation(f"the rgpu server closed the connection: {exc}"))
            return
        with self._state_lock:  # not self.lock: the main thread may hold it, waiting on us
            if self._reconnecting or self.closed:
                return
            self._reconnecting = True
        log.warning("rgpu: lost the connection to %s (%s); reconnecting", self.url, exc)
        threading.Thread(target=self._reconnect, name="rgpu-reconnect", daemon=True).start()

    def _reconnect(self) -> None:
        """Reconnect with backoff, resume the session, and replay what the server lacks."""
        deadline = time.monotonic() + self.reconnect_s
        delay = 0.05
        old = self.conn
        old.close(CloseCode.GOING_AWAY)  # not BYE: the server must keep the session for us
        while not self.closed:
            try:
                if self.transport is not None:
                    self.url = split_token(self.transport.ensure())[0]
                conn = self._open(self._session_bytes)
            except SessionLost as e:
                self._mark_broken(e)
                return
            except Exception as e:  # unreachable, refused, dropped mid-handshake: try again
                if isinstance(e, AuthError) or time.monotonic() > deadline:
                    self._mark_broken(ConnectionLost(
                        f"could not reach the rgpu server at {self.url} again within "
                        f"{self.reconnect_s:.0f} s ({e}); this session's tensors are unreachable. "
                        "Call rgpu.connect() to start a new session."))  # fmt: skip
                    return
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
                continue
            with self.lock:
                if self.closed:
                    conn.close()
                    return
                self._writer.close(timeout=0)
                self.conn = conn
                self._writer = self._new_writer(conn)
                applied = int(conn.welcome.get("last_seq", 0))
                self._replay.ack(applied)
                self._reconnecting = False
                try:
                    for seq in sorted(self._unanswered):  # applied, but the reply may be lost
                        if seq <= applied:
                            self._send(batch_frame(seq, [self._unanswered[seq]]))
                    self._replay_unacked()
                except RgpuError:
                    return
                self.reconnects += 1
            log.warning("rgpu: resumed the session on %s", self.url)
            if conn.closed:  # it dropped again before we were watching
                self._connection_lost(ConnectionLost("the connection dropped during the resume"))
            return

    def _replay_unacked(self) -> None:
        """Send again, in order, every message the server did not confirm (lock held)."""
        batch: list[bytes] = []
        size = 0
        first = 0
        cap = min(self.flush_bytes, self.max_message - 1024)
        for seq, data, upload in self._replay.pending():
            if batch and size + len(data) > cap:
                self._send(batch_frame(first, batch))
                batch, size = [], 0
            if not batch:
                first = seq
            batch.append(data)
            size += len(data)
            if upload is not None or len(batch) >= self.flush_ops:
                self._send(batch_frame(first, batch))
                batch, size = [], 0
                if upload is not None:
                    self._send_chunks(seq, upload)
        if batch:
            self._send(batch_frame(first, batch))

    def _send_chunks(
        self, seq: int, upload: ChunkedUpload, tag: object = None, hasher: Any = None
    ) -> None:
        """Queue an upload's chunks; `hasher`, if given, hashes each chunk while the writer thread
        sends the ones before it (hashlib releases the GIL), for content addressing."""
        if not upload.unchanged():  # its source changed since: cancel rather than send other bytes
            self._send(chunk_frame(Frame.CHUNK, seq, ABORT_OFFSET, b""))
            return
        data = byte_view(upload.src)
        chunk = self.max_chunk
        for off in range(0, upload.nbytes, chunk):
            piece = data[off : off + chunk]
            upload.ticket = self._send(chunk_frame(Frame.CHUNK, seq, off, piece), tag)
            if hasher is not None:
                hasher.update(piece)
        upload.writer = self._writer

    def _mark_broken(self, exc: BaseException) -> None:
        if self._broken is None:
            self._broken = exc
        for w in list(self._waiters.values()):
            w.event.set()

    # -- transfers ---------------------------------------------------------------------------

    def upload(self, dst: RemoteTensor, src: torch.Tensor) -> None:
        """Copy a CPU tensor's bytes into `dst` on the server; the bytes are taken now."""
        src = src.detach().resolve_conj().resolve_neg().contiguous()
        nbytes = src.numel() * src.element_size()
        index = self.uploads
        index.settle()
        sha = None
        if index.enabled and nbytes >= index.min_bytes:
            if index.worth_hashing(src) or nbytes <= INLINE_UPLOAD:
                sha = dedup.digest(byte_view(src))
                holder = index.find(src, sha)
                if holder is not None and holder is not dst:
                    # the server already has these bytes in `holder`: copy there, send nothing
                    self.post((_RUN, "copy_.default", [dst, holder], None, [None]))
                    index.hits += 1
                    index.bytes_saved += nbytes
                    index.remember(dst, src, sha)
                    return
        if nbytes <= INLINE_UPLOAD:
            self._pending_data_bytes += nbytes  # before post(), which may flush
            self.post((Kind.UPLOAD, dst, src))
            if sha is not None:
                index.remember(dst, src, sha)
            return
        lane = self._lane_for(nbytes)
        if lane is not None:
            # hashing (about 1.2 GB/s) pays only where sending is slower than that
            hash_too = index.enabled and not sha and self.lane_bps < LANE_HASH_BELOW_BPS
            sent, digest = self._upload_by_lane(lane, dst, src, nbytes, hash_too)
            if sent:
                if index.enabled and (sha or digest):  # unhashed lane uploads are not remembered
                    index.remember(dst, src, sha or digest)
                return
        hasher = hashlib.sha256() if index.enabled and sha is None else None
        tag = object()  # marks this upload's chunks in the writer's queue
        upload = ChunkedUpload(src, src._version, nbytes)
        progress = TransferProgress(nbytes, "rgpu upload")
        start = self._writer.bytes_written
        try:
            with self.lock:
                self._check_usable()
                self._drain_frees_locked()
                seq = self._append_locked((Kind.UPLOAD, dst, [src.dtype, list(src.shape), nbytes]))
                self.bytes_out += nbytes
                try:
                    self._flush_locked(upload)
                    self._send_chunks(seq, upload, tag, hasher)
                except BaseException:
                    self._cancel_upload(seq, tag)
                    raise
            # the call returns once every byte is written (or the server has it): the caller may
            # change `src` after that
            try:
                while not upload.done.is_set():
                    writer = upload.writer
                    if (
                        writer is not None
                        and upload.ticket
                        and writer.wait_written(upload.ticket, 0.1)
                    ):
                        break
                    if writer is None or not upload.ticket:
                        upload.done.wait(0.1)
                    self._check_usable()
                    progress.update_to(self._writer.bytes_written - start)
            except BaseException:
                with self.lock:
                    self._cancel_upload(seq, tag)
                raise
            if index.enabled:
                index.remember(dst, src, sha if sha is not None else hasher.digest())
        finally:
            progress.close()

    def _upload_by_lane(
        self, lane: Lane, dst: RemoteTensor, src: torch.Tensor, nbytes: int, hash_too: bool
    ) -> tuple[bool, bytes]:
        """Stage the bytes on the server over the lane, then post the UPLOAD that claims them.
        (False, _) with nothing posted when the lane failed: the caller sends them over the
        websocket. With `hash_too`, a thread hashes the bytes for dedup while they go out (both
        release the GIL); the digest comes back second."""
        ticket = next(self._tickets)
        progress = TransferProgress(nbytes, "rgpu upload")
        digest: list[bytes] = [b""]
        hasher = None
        if hash_too:
            hasher = threading.Thread(
                target=lambda: digest.__setitem__(0, dedup.digest(byte_view(src))),
                name="rgpu-hash",
                daemon=True,
            )
            hasher.start()
        t0 = time.perf_counter()
        try:
            lane.put(ticket, byte_view(src), progress.update_to)
            self.lane_bps = nbytes / max(time.perf_counter() - t0, 1e-6)
            if hasher is not None:
                hasher.join()
        except LaneError as e:
            self._lane_failed(lane, e)
            return False, b""
        except BaseException:  # Ctrl-C: the destination must say it holds no data
            self.post((Kind.UPLOAD, dst, [src.dtype, list(src.shape), nbytes, INTERRUPTED_TICKET]))
            raise
        finally:
            progress.close()
        self.post((Kind.UPLOAD, dst, [src.dtype, list(src.shape), nbytes, ticket]))
        self.bytes_out += nbytes
        self.lane_transfers += 1
        return True, digest[0]

    def _lane_for(self, nbytes: int) -> Lane | None:
        """The open lane, opening it if need be, when a transfer of `nbytes` should use it."""
        if (
            not self.lane_enabled
            or nbytes < self.lane_min_bytes
            or nbytes < self.link_rtt_s * LANE_BYTES_PER_RTT
            or self._lane_info is None
            or os.environ.get("RGPU_PROXY")  # the websocket library speaks to proxies; we don't
        ):
            return None
        with self._lane_lock:
            lane = self._lane
            if lane is not None and not lane.closed:
                return lane
            if time.monotonic() < self._lane_retry_at:
                return None
            try:
                lane = Lane(
                    self.url,
                    path=str(self._lane_info.get("path", "/lane")),
                    token=self._token,
                    session=self._session_bytes,
                    key=bytes(self._lane_info.get("key", b"")),
                    ssl_context=ssl_context(self.url),
                    timeout=self._open_timeout,
                )
            except Exception as e:  # refused, unreachable, TLS: the websocket carries the bytes
                log.info(
                    "rgpu: no bulk lane to %s (%s); large transfers use the websocket", self.url, e
                )
                self._lane_retry_at = time.monotonic() + LANE_RETRY_S
                self._lane = None
                return None
            self._lane = lane
            return lane

    def _lane_failed(self, lane: Lane, exc: BaseException) -> None:
        log.info("rgpu: the bulk lane failed (%s); the transfer goes over the websocket", exc)
        lane.close()

    def _cancel_upload(self, seq: int, tag: object) -> None:
        """Withdraw an upload's unwritten chunks and tell the server to drop it (dst is poisoned)."""
        self._writer.withdraw(tag)
        if self._broken is not None or self.closed:
            return
        if self._pending:
            self._flush_locked()  # the UPLOAD message itself, if the interrupt beat its flush
        self._send(chunk_frame(Frame.CHUNK, seq, ABORT_OFFSET, b""))

    def download(self, w: RemoteTensor) -> torch.Tensor:
        """The values of `w` as a new CPU tensor with the same shape (one wait)."""
        dtype = w.dtype
        shape = tuple(w.shape)
        numel = w.numel()
        flat = torch.empty(numel, dtype=dtype)
        nbytes = numel * flat.element_size()
        view = byte_view(flat)
        timing = [0.0, 0.0, 0]  # first DATA frame's arrival, the last one's, the first's size

        def sink(offset: int, payload: memoryview) -> None:
            if timing[2]:
                timing[1] = time.perf_counter()
            else:
                timing[0], timing[2] = time.perf_counter(), len(payload)
            view[offset : offset + len(payload)] = payload

        lane = self._lane_for(nbytes)
        if lane is None or not self._download_by_lane(lane, w, view, sink):
            value = self.request(
                (Kind.DOWNLOAD, w), sink, progress=TransferProgress(nbytes, "rgpu download")
            )
            _fill(view, nbytes, value)
        if nbytes >= LINK_PROBE_BYTES and timing[1] > timing[0]:
            # the pace of the data itself, not the wait for the ops before it
            self.link_bps = (nbytes - timing[2]) / (timing[1] - timing[0])
        out = flat.view(shape)
        stride = w.stride()
        if out.stride() != stride and dense_strides(shape, stride):
            out = torch.empty_strided(shape, stride, dtype=dtype).copy_(out)
        return out

    def _download_by_lane(
        self, lane: Lane, w: RemoteTensor, view: memoryview, sink: Callable
    ) -> bool:
        """Ask for the bytes on the lane (one wait). False when they must be asked for again
        over the websocket: the lane closed before they were all in."""
        nbytes = len(view)
        ticket = next(self._tickets)
        try:
            receipt = lane.expect(ticket, view)
        except LaneError:
            return False
        try:
            value = self.request((Kind.DOWNLOAD, w, ticket), sink)
        except BaseException:
            lane.forget(ticket)
            raise
        if not (type(value) is list and len(value) == 2 and value[0] == "lane"):
            lane.forget(ticket)  # the server sent them inline or over the websocket
            _fill(view, nbytes, value)
            return True
        if value[1] != nbytes:
            lane.forget(ticket)
            raise ProtocolViolation(f"download of {nbytes} bytes returned {value[1]}")
        progress = TransferProgress(nbytes, "rgpu download")
        t0 = time.perf_counter()
        try:
            ok = lane.wait(receipt, ticket, progress.update_to)
        finally:
            progress.close()
            self.wait_seconds += time.perf_counter() - t0
        if not ok:
            self._lane_failed(lane, LaneError("it closed during a download"))
            return False
        self.bytes_in += nbytes
        self.lane_transfers += 1
        return True

    def download_async(self, w: RemoteTensor, into: torch.Tensor | None = None) -> torch.Tensor:
        """Non-blocking readback: a CPU tensor returned now and filled when the reply arrives.

        Read it after `torch.rgpu.synchronize()` or once an `rgpu.Event` recorded after this
        call reports done; a failure is raised at the next wait. No wait is spent here."""
        numel = w.numel()
        shape = tuple(w.shape)  # the closures below must not keep `w` alive: freed on the reader
        # thread, its FREE would join the stream at a moment that depends on timing
        target = into if into is not None else torch.empty(shape, dtype=w.dtype)
        direct = target.is_contiguous() and target.dtype == w.dtype and target.numel() == numel
        flat = target.reshape(-1) if direct else torch.empty(numel, dtype=w.dtype)
        nbytes = numel * flat.element_size()
        view = byte_view(flat)

        def sink(offset: int, payload: memoryview) -> None:
            view[offset : offset + len(payload)] = payload

        def done(waiter: Waiter) -> None:  # the reader thread, as the reply lands
            try:
                if waiter.status is Status.OK:
                    _fill(view, nbytes, waiter.value)
                    if not direct:
                        target.copy_(flat.view(shape))
                elif waiter.status is Status.ERROR:
                    self._note_async_error(waiter)
            except Exception as e:
                self._async_error = e

        self.check_async_error()
        self.request_async((Kind.DOWNLOAD, w), sink, on_done=done, detached=True)
        self.async_readbacks += 1
        return target

    def record_event(self) -> Waiter:
        """A marker in the op stream: its waiter finishes once the server has run everything
        before it; the reply carries the server's clock then (for `Event.elapsed_time`)."""

        def done(waiter: Waiter) -> None:
            if waiter.status is Status.ERROR:
                self._note_async_error(waiter)

        self.check_async_error()
        return self.request_async((Kind.SYNC,), on_done=done, detached=True)

    def _note_async_error(self, waiter: Waiter) -> None:
        """Keep the first failure of a reply nobody waited for, to raise at the next wait."""
        if self._async_error is None:
            op, message = waiter.value
            error = RemoteError(str(op), str(message))
            error.rgpu_seq = waiter.seq
            self._async_error = error

    # -- lifecycle ---------------------------------------------------------------------------

    def info(self) -> dict:
        return self.request((Kind.INFO,))

    def close(self) -> None:
        """End the session: the server frees its tensors now (no resume)."""
        if self.closed:
            return
        with self.lock:
            try:
                if self._broken is None and not self._reconnecting:
                    self._flush_locked()
            except Exception:
                pass
            self.closed = True
        self._quiet_kick.set()
        self._writer.close()
        self.conn.close(CloseCode.BYE)
        if self._lane is not None:
            self._lane.close()
        for w in list(self._waiters.values()):
            w.event.set()
        if self.local_process is not None:
            self.local_process.stop()
        if self.transport is not None:
            self.transport.stop()

    @property
    def state(self) -> str:
        """ "connected", "reconnecting", "lost" (gave up) or "closed" (disconnected on purpose)."""
        if self.closed:
            return "closed"
        if self._broken is not None:
            return "lost"
        if self._reconnecting:
            return "reconnecting"
        return "connected"

    def ping(self, timeout: float = 10.0) -> float:
        """Round-trip time to the server in seconds, measured now (a websocket ping)."""
        self._check_usable()
        t0 = time.perf_counter()
        pong = self.conn.ws.ping()
        if not pong.wait(timeout):
            raise ConnectionLost(
                f"the rgpu server at {self.url} did not answer a ping within {timeout} s"
            )
        self.link_rtt_s = time.perf_counter() - t0
        return self.link_rtt_s

    def stats(self) -> dict:
        return {
            "messages": self.messages,
            "waits": self.waits,
            "bytes_out": self.bytes_out - self.compression_saved,  # on the wire
            "bytes_in": self.bytes_in,
            "frames": self.frames,
            "wait_seconds": self.wait_seconds,
            "reconnects": self.reconnects,
            "async_readbacks": self.async_readbacks,
            "dedup_hits": self.uploads.hits,
            "dedup_bytes_saved": self.uploads.bytes_saved,
            "compressed_frames": self.compressed_frames,
            "compression_saved": self.compression_saved,
            "lane_transfers": self.lane_transfers,
        }


def _fill(view: memoryview, nbytes: int, value: Any) -> None:
    """Finish a download: an inline reply carries the bytes, a chunked one their count."""
    if type(value) is bytes:
        if len(value) != nbytes:
            raise ProtocolViolation(f"download of {nbytes} bytes returned {len(value)}")
        if nbytes:
            view[:] = value
    elif value != nbytes:
        raise ProtocolViolation(f"download of {nbytes} bytes returned {value}")


def dense_strides(shape: tuple, stride: tuple) -> bool:
    """True when `stride` is a permutation of contiguous strides (no gaps, no overlap)."""
    if 0 in shape:
        return True
    dims = [(st, sz) for sz, st in zip(shape, stride) if sz != 1]
    dims.sort()
    expected = 1
    for st, sz in dims:
        if st != expected:
            return False
        expected *= sz
    return True
