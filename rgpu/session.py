"""A session with one server: the I/O around the op stream, waits, and the counters.

The stream itself — message numbers, batches, what the server confirmed, reply routing, what to
send again after a dropped connection — is `rgpu_protocol.client_stream.ClientStream`, which does
no I/O. Around it: ops are encoded the moment they are issued (so a bad argument fails on the
user's line) and queued; the queue goes out as one BATCH frame when an answer is needed (a wait),
when it holds `flush_ops` messages or `flush_bytes` bytes, or when the client has been quiet for
`quiet_us`, so the server computes while the client is still issuing ops. One writer thread sends
frames (rgpu.writer), one reader thread routes what comes back (rgpu.connection). Transfers are in
rgpu.transfers, the reconnect loop in rgpu.reconnect, link measurements in rgpu.link.

Locks: `lock` orders what producers send (a batch goes out, then the next); `_core` guards the
stream's record of sent messages, which the reader thread updates too, and is never held while
blocking. Queueing a message touches only the queue, which only producers (under `lock`) touch.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

import torch

from rgpu_protocol import (
    CloseCode,
    EncodeError,
    Encoder,
    Kind,
    Welcome,
    byte_view,
    default,
    host_ext,
)
from rgpu_protocol.client_stream import FIRST, FULL, ClientStream

from . import dedup, generator_refs
from .config import Config
from .connection import Connection, split_token
from .counters import Counters
from .errors import ConnectionLost, RgpuError
from .link import Link
from .peek import Peeks
from .progress import settings
from .reconnect import ReconnectMixin
from .replay import Replayer
from .sites import OpSites
from .tensor import RemoteTensor
from .transfers import UPLOAD_CHUNK, ChunkedUpload, TransferMixin
from .waits import WaitMixin
from .writer import FrameWriter

FREE_BYTES = 1 << 20  # freed tensors holding this much go to the server before the next op...
FREE_COUNT = 1024  # ...and so do this many; otherwise frees ride along with the next wait


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
    if isinstance(obj, torch._C.Generator):  # torch.Generator(device="rgpu"): generators.py
        return generator_refs.wire(obj)
    return default(obj)


class Session(WaitMixin, TransferMixin, ReconnectMixin):
    """One client session with one server: it survives dropped connections by resuming."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        open_timeout: float = 10.0,
        config: Config | None = None,
        local_process: Any = None,
        transport: Any = None,
        name: str | None = None,
        takeover: bool = False,
    ) -> None:
        """`transport`, when given, carries the connection (an SSH tunnel, a Slurm job):
        before every reconnect, `transport.ensure()` re-opens it if it died and returns the URL
        to use (or raises `SessionLost` when the server is gone for good); the session calls
        `transport.stop()` when it ends. When the server shuts down, an optional
        `transport.ended()` may return the `SessionLost` that says why. `name` opens (or
        re-opens) a named session, which outlives this process; `takeover` takes it from a
        client holding it."""
        self.name = name
        self._takeover = takeover
        self.config = config = config if config is not None else Config.from_env()
        self.transport = transport
        self.local_process = local_process
        self.url, url_token = split_token(url)
        self.token = token or url_token
        self.open_timeout = open_timeout
        self.lock = threading.RLock()
        self._core = threading.Lock()
        self._confirmations = threading.Condition(self._core)  # flow control waits on this
        self._state_lock = threading.Lock()
        self.frees: collections.deque[int] = collections.deque()
        self.free_bytes = 0  # storage bytes behind `frees`
        self.check_meta = config.check_meta
        self.quiet_s = config.quiet_us / 1e6
        # counters (see Counters)
        self.messages = self.waits = self.bytes_out = self.bytes_in = self.frames = 0
        self.wait_seconds = 0.0
        self.reconnects = self.async_readbacks = 0
        self.link = Link(config)
        self.async_error: BaseException | None = None  # from a non-blocking readback
        self.broken: BaseException | None = None
        self.reconnecting = False
        self.closed = False
        self._encode = Encoder(_encode_hook).encode
        self._quiet_kick = threading.Event()
        self.conn = self.open_connection(resume=False)
        welcome: Welcome = self.conn.welcome
        self.welcome = welcome
        self.session_bytes = welcome.session
        self.session_id: str = welcome.session.hex()
        self.server_torch = welcome.torch
        self.server_version = welcome.server
        self.device = welcome.device
        self.device_name = welcome.device_name
        self.devices = welcome.device_list  # (server device, name) per index on this server
        self.device_base = 0  # the global index of this server's device 0 (rgpu.devices)
        self.wire_device = 0  # the device the server runs this session's messages on now
        self.max_chunk = min(welcome.max_chunk, UPLOAD_CHUNK)
        self.max_message = welcome.max_message
        self.stream = ClientStream(
            flush_ops=config.flush_ops,
            flush_bytes=config.flush_bytes,
            max_message=welcome.max_message,
            replay_limit=config.replay_bytes,
        )
        self.writer = self.new_writer(self.conn)
        self.graphs: set[str] = set()  # compiled graphs this session already sent (by content key)
        self.uploads = dedup.UploadIndex(enabled=config.dedup, min_bytes=config.dedup_min_bytes)
        self.sites = OpSites()  # where ops were queued, when rgpu.settings.op_sites is on
        self.record_sites = False
        self.peeks = Peeks()  # live facts asked out of band (rgpu.peek)
        self.replay = Replayer(self, _encode_hook, config.replay)  # replayed steps (rgpu.replay)
        settings.watch(self)
        self._quiet = threading.Thread(
            target=self._quiet_loop, name="rgpu-quiet-flush", daemon=True
        )
        self._quiet.start()

    def open_connection(self, resume: bool) -> Connection:
        mine: list[Connection] = []

        def on_close(exc: BaseException) -> None:  # only the current connection's loss matters
            if mine and mine[0] is self.conn:
                self.connection_lost(exc)

        conn = Connection(
            self.url,
            token=self.token,
            on_frame=self._on_frame,
            on_close=on_close,
            open_timeout=self.open_timeout,
            config=self.config,
            resume=self.session_bytes if resume else None,
            name=self.name,
            takeover=self._takeover and not resume,
        )
        mine.append(conn)
        self.link.connected(conn)
        return conn

    def new_writer(self, conn: Connection) -> FrameWriter:
        def failed(exc: BaseException) -> None:
            if self.conn is conn:
                self.connection_lost(exc)

        return FrameWriter(conn.send, failed, self.link.wire_form)

    @property
    def compressing(self) -> bool:
        return self.link.compressing

    # -- the queue ---------------------------------------------------------------------------

    def check_usable(self) -> None:
        if self.broken is not None:
            if isinstance(self.broken, RgpuError):
                raise self.broken
            raise ConnectionLost(
                f"the connection to the rgpu server at {self.url} is lost ({self.broken}); "
                "its tensors are unreachable. Call rgpu.connect() to start a new session."
            )
        if self.closed:
            raise RgpuError(
                "this rgpu session was disconnected; its tensors are gone. Call rgpu.connect()."
            )

    def post(self, msg: tuple, data_bytes: int = 0, device: int | None = None) -> None:
        """Queue a message that needs no answer (`data_bytes`: inline tensor bytes in it), to
        run on this server's device `device` (None: whichever the last message ran on); a RUN
        may be held instead, for a replayed sequence (rgpu.replay)."""
        if self.uploads._unsettled:  # before this op can change a tensor an upload went into
            self.uploads.settle()
        with self.lock:
            if self.broken is not None or self.closed:
                self.check_usable()
            if self.free_bytes >= FREE_BYTES or len(self.frees) >= FREE_COUNT:
                self._drain_frees_locked()  # big or many: let the server reuse that memory now
            if device is not None and device != self.wire_device:
                self.to_device_locked(device)
            if self.replay.on and self.replay.offer(msg):
                flow = self.replay.sent and self.stream.over_limit
            else:
                flow = self.queue_locked(msg, data_bytes)
        if flow:
            self._wait_for_confirmations()

    def queue_locked(self, msg: tuple, data_bytes: int = 0, sites: list | None = None) -> bool:
        """Queue one message (lock held; `sites`: a REPLAY's ops'); True: flow control waits."""
        data = self._encode(msg)
        queued = self.stream.append(data, data_bytes)
        self.bytes_out += len(data)
        self.messages += 1
        if self.record_sites:
            self.sites.note(self.stream.next_seq - 1, 3, sites)
        if queued == FULL:
            self.flush_locked()
            return self.stream.over_limit
        if queued == FIRST:
            self._quiet_kick.set()
        return False

    def post_chunked(self, msg: tuple, nbytes: int, upload: ChunkedUpload) -> int:
        """Queue a chunked UPLOAD and send the queue, ending with it (lock held); its chunks
        must follow at once. Returns its sequence number."""
        self.check_usable()
        self.replay.end()
        self._drain_frees_locked()
        data = self._encode(msg)
        self.stream.append(data)
        self.bytes_out += len(data) + nbytes
        self.messages += 1
        seq = self.stream.next_seq - 1
        self.flush_locked(upload)
        return seq

    def flush(self) -> None:
        """Send everything queued, frees included (no wait). Jupyter calls it between cells."""
        with self.lock:
            self.replay.end()  # a flush ends the segment (Jupyter: between cells)
            if self.stream.pending or self.frees:
                self.check_usable()
                self._drain_frees_locked()
                self.flush_locked()

    def send_queued(self) -> None:
        """Send the queue now (no wait, no segment end): after a message that holds much work."""
        with self.lock:
            if self.stream.pending and self.broken is None and not self.closed:
                self.flush_locked()

    def to_device_locked(self, device: int) -> None:
        """Queue DEVICE: the server runs the messages after it on `device` (lock held)."""
        self.replay.end()  # held ops run on the device they were issued for: they go first
        data = self._encode((Kind.DEVICE, device))
        self.stream.append(data)
        self.bytes_out += len(data)
        self.messages += 1
        self.wire_device = device

    def _drain_frees_locked(self) -> None:
        """Turn the ids of garbage-collected tensors into one FREE message."""
        frees = self.frees
        if frees:
            self.replay.cut()  # held ops may make the ids being freed: they go first
            ids = []
            try:
                while True:
                    ids.append(frees.popleft())
            except IndexError:
                pass
            self.free_bytes = 0
            data = self._encode((Kind.FREE, ids))
            self.stream.append(data)
            self.bytes_out += len(data)
            self.messages += 1

    def flush_locked(self, upload: ChunkedUpload | None = None) -> None:
        """Send the queue (lock held). With `upload`, the queue ends with that UPLOAD message,
        whose chunks follow. Frees are not drained here but at op boundaries (waits, `flush`,
        or when they pile up), so the message count does not depend on when flushes happen."""
        stream = self.stream
        while True:
            batch = stream.batch(upload)
            if batch is None:
                return
            # a batch that is mostly tensor bytes (inline uploads) would barely shrink
            self.send(batch.frame, compressible=2 * batch.data_bytes < batch.nbytes)
            # only now is it recorded as sent: if an interrupt lands before this line, the
            # messages go out again with the same numbers, and the server drops the repeats
            with self._core:
                stream.sent(batch)

    def _wait_for_confirmations(self) -> None:
        """Flow control: the server is far behind; let it catch up before queueing more.
        Called without the session lock held, so a reconnect can replay meanwhile."""
        try:
            while True:
                with self._core:
                    if not self.stream.over_limit:
                        return
                    self._confirmations.wait(0.1)
                self.check_usable()
        except KeyboardInterrupt as e:
            self.interrupted(e)
            raise

    def send(self, frame: bytes | list, tag: object = None, compressible: bool = False) -> int:
        """Hand a frame to the writer thread; returns its ticket (0 while reconnecting: the
        resume sends it). A `compressible` frame holds no tensor bytes."""
        self.check_usable()
        if self.reconnecting:
            return 0
        nbytes = len(frame) if type(frame) is bytes else sum(len(b) for b in frame)
        ticket = self.writer.queue(frame, nbytes, tag, compressible)
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
                if self.stream.pending and self.broken is None and not self.closed:
                    try:
                        self.flush_locked()
                    except RgpuError:
                        pass

    # -- lifecycle ---------------------------------------------------------------------------

    def info(self) -> dict:
        return self.request((Kind.INFO,))

    def peek(self, timeout: float = 2.0) -> dict | None:
        """Live device facts and what this session holds, asked out of band: not a message,
        not a wait, not behind queued work (rgpu.peek). None when the server cannot say."""
        return self.peeks.ask(self, timeout)

    @property
    def kept_names(self) -> tuple[str, ...]:
        """What the named session held for this client when it re-opened it (rgpu.kept)."""
        return self.welcome.kept

    def close(self, drop: bool = False) -> None:
        """End the session: the server frees its tensors now (no resume). A named session is
        only left, for a later client, unless `drop`."""
        if self.closed:
            return
        with self.lock:
            try:
                if self.broken is None and not self.reconnecting:
                    self.replay.end()
                    self.flush_locked()
            except Exception:
                pass
            self.closed = True
        self._quiet_kick.set()
        self.writer.close()
        self.conn.close(CloseCode.KEEP if self.name is not None and not drop else CloseCode.BYE)
        self.link.close()
        for w in self.stream.waiters():
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
        if self.broken is not None:
            return "lost"
        if self.reconnecting:
            return "reconnecting"
        return "connected"

    def ping(self, timeout: float = 10.0) -> float:
        """Round-trip time to the server in seconds, measured now (a websocket ping)."""
        self.check_usable()
        t0 = time.perf_counter()
        pong = self.conn.ws.ping()
        if not pong.wait(timeout):
            raise ConnectionLost(
                f"the rgpu server at {self.url} did not answer a ping within {timeout} s"
            )
        self.link.rtt_s = time.perf_counter() - t0
        return self.link.rtt_s

    def stats(self) -> dict:
        link = self.link
        return Counters(
            messages=self.messages,
            waits=self.waits,
            bytes_out=self.bytes_out - link.compression_saved,  # on the wire
            bytes_in=self.bytes_in,
            frames=self.frames,
            wait_seconds=self.wait_seconds,
            reconnects=self.reconnects,
            async_readbacks=self.async_readbacks,
            dedup_hits=self.uploads.hits,
            dedup_bytes_saved=self.uploads.bytes_saved,
            compressed_frames=link.compressed_frames,
            compression_saved=link.compression_saved,
            lane_transfers=link.lane_transfers,
            replayed_ops=self.replay.replayed_ops,
        ).as_dict()
