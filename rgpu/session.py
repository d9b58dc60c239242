"""A session with one server: the op queue, batching, waits, transfers and the counters.

Ops are encoded the moment they are issued (so a bad argument fails on the user's line) and kept
in a queue. The queue goes out as one BATCH frame when an answer is needed (a wait), when it holds
`flush_ops` messages or `flush_bytes` bytes, or when the client has been quiet for `quiet_s`, so
the server computes while the client is still issuing ops.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from .connection import Connection, split_token
from .errors import (
    AuthError,
    ConnectionLost,
    ProtocolViolation,
    RemoteError,
    RgpuError,
    SessionLost,
)
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
    default,
    host_ext,
    parse_ack,
    parse_chunk,
    parse_reply,
)
from .replay import ChunkedUpload, ReplayBuffer
from .tensor import RemoteTensor
from .writer import FrameWriter

log = logging.getLogger("rgpu")

INLINE_UPLOAD = 256 * 1024  # uploads up to this size ride inside the op stream
UPLOAD_CHUNK = 1 << 20  # small enough that an interrupted upload stops within one chunk
ABORT_OFFSET = (1 << 64) - 1  # a CHUNK at this offset cancels the upload it belongs to
FREE_BYTES = 1 << 20  # freed tensors holding this much go to the server before the next op...
FREE_COUNT = 1024  # ...and so do this many; otherwise frees ride along with the next wait


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

    __slots__ = ("event", "status", "value", "sink", "received", "on_abandoned")

    def __init__(self, sink: Callable[[int, memoryview], None] | None = None) -> None:
        self.event = threading.Event()
        self.status: Status | None = None
        self.value: Any = None
        self.sink = sink
        self.received = 0  # DATA bytes routed to the sink so far
        self.on_abandoned: Callable[[Status, Any], None] | None = None  # a reply nobody waits for

    def finish(self, status: Status, value: Any) -> None:
        self.status = status
        self.value = value
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
        # The queue: messages _first_seq, _first_seq + 1, ... not yet handed to the writer. A
        # message's sequence number is its position, never a separate counter, so an interrupt
        # between two statements cannot make numbers and messages disagree.
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._first_seq = 1
        self._replay = ReplayBuffer(_env_int("RGPU_REPLAY_BYTES", 256 << 20))
        self._waiters: dict[int, Waiter] = {}
        self._abandoned: dict[int, Waiter] = {}
        # waited messages without a reply yet: sent again after a reconnect even if the server
        # applied them, so it resends a reply the dropped connection swallowed
        self._unanswered: dict[int, bytes] = {}
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
        self.flush_bytes = min(self.flush_bytes, self.max_message // 2)
        self._writer = self._new_writer(self.conn)
        self.graphs: set[str] = set()  # compiled graphs this session already sent (by content key)
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
        return conn

    def _new_writer(self, conn: Connection) -> FrameWriter:
        def failed(exc: BaseException) -> None:
            if self.conn is conn:
                self._connection_lost(exc)

        return FrameWriter(conn.send, failed)

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
        self._send(batch_frame(first, pending))
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

    def _send(self, frame: bytes | list, tag: object = None) -> int:
        """Hand a frame to the writer thread; returns its ticket (0 while reconnecting: the
        replay after the reconnect sends it)."""
        self._check_usable()
        if self._reconnecting:
            return 0
        nbytes = len(frame) if type(frame) is bytes else sum(len(b) for b in frame)
        ticket = self._writer.queue(frame, nbytes, tag)
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
            while True:
                time.sleep(self.quiet_s)
                now = self.messages
                if now == last:
                    break
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
        waiter = Waiter(sink)
        waiter.on_abandoned = on_abandoned
        with self.lock:
            self._check_usable()
            self._drain_frees_locked()  # so a waited INFO sees memory the client already let go
            seq = self._append_locked(msg)
            self._waiters[seq] = waiter
            self._unanswered[seq] = self._pending[-1]
            self._flush_locked()
        self.waits += 1
        t0 = time.perf_counter()
        try:
            self._wait(seq, waiter, progress)
        finally:
            self.wait_seconds += time.perf_counter() - t0
        status = waiter.status
        if status is Status.OK:
            return waiter.value
        if status is Status.ERROR:
            op, message = waiter.value
            raise RemoteError(str(op), str(message))
        if status is None:  # woken by a lost connection
            self._check_usable()
        raise ProtocolViolation(f"the rgpu server could not understand this client: {waiter.value}")

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
            if waiter is not None and waiter.on_abandoned is not None:
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

    def _send_chunks(self, seq: int, upload: ChunkedUpload, tag: object = None) -> None:
        if not upload.unchanged():  # its source changed since: cancel rather than send other bytes
            self._send(chunk_frame(Frame.CHUNK, seq, ABORT_OFFSET, b""))
            return
        data = byte_view(upload.src)
        chunk = self.max_chunk
        for off in range(0, upload.nbytes, chunk):
            upload.ticket = self._send(
                chunk_frame(Frame.CHUNK, seq, off, data[off : off + chunk]), tag
            )
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
        if nbytes <= INLINE_UPLOAD:
            self.post((Kind.UPLOAD, dst, src))
            return
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
                    self._send_chunks(seq, upload, tag)
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
        finally:
            progress.close()

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

        def sink(offset: int, payload: memoryview) -> None:
            view[offset : offset + len(payload)] = payload

        value = self.request(
            (Kind.DOWNLOAD, w), sink, progress=TransferProgress(nbytes, "rgpu download")
        )
        if type(value) is bytes:
            if len(value) != nbytes:
                raise ProtocolViolation(f"download of {nbytes} bytes returned {len(value)}")
            if nbytes:
                view[:] = value
        elif value != nbytes:
            raise ProtocolViolation(f"download of {nbytes} bytes returned {value}")
        out = flat.view(shape)
        stride = w.stride()
        if out.stride() != stride and _dense(shape, stride):
            out = torch.empty_strided(shape, stride, dtype=dtype).copy_(out)
        return out

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
        return time.perf_counter() - t0

    def stats(self) -> dict:
        return {
            "messages": self.messages,
            "waits": self.waits,
            "bytes_out": self.bytes_out,
            "bytes_in": self.bytes_in,
            "frames": self.frames,
            "wait_seconds": self.wait_seconds,
            "reconnects": self.reconnects,
        }


def _dense(shape: tuple, stride: tuple) -> bool:
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
