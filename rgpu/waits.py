"""Waits: a waited message's reply, routed by the reader thread to whoever waits for it.

`WaitMixin` is the half of `rgpu.session.Session` that sends waited messages and blocks for
their replies (or lets a callback take them), and that routes every frame the server sends
through the stream core.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from rgpu_protocol import Kind, Status, cancel_frame
from rgpu_protocol.client_stream import Acked, Data, Failed, Reply

from .errors import ProtocolViolation, RemoteError, RgpuError, shown_briefly
from .peek import PEEK_REPLY
from .progress import TransferProgress


class Waiter:
    """One waited message: the reply, and where DATA frames for it go.

    A *detached* waiter is one nobody waits for (a non-blocking readback, an event): its reply
    runs `on_done` on the reader thread. An *abandoned* one was waited for until Ctrl-C: its
    reply goes to `on_abandoned` (e.g. to free the outputs of a data-dependent op)."""

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
        "abandoned",
    )

    def __init__(
        self,
        sink: Callable[[int, memoryview], None] | None = None,
        on_done: Callable[[Waiter], None] | None = None,
    ) -> None:
        self.event = threading.Event()
        self.status: Status | None = None
        self.value: Any = None
        self.sink = sink
        self.received = 0  # DATA bytes routed to the sink so far
        self.on_abandoned: Callable[[Status, Any], None] | None = None
        self.on_done = on_done  # runs on the reader thread
        self.seq = 0
        self.done_at = 0.0
        self.abandoned = False

    def finish(self, status: Status, value: Any) -> None:
        self.status = status
        self.value = value
        self.done_at = time.perf_counter()
        if self.on_done is not None:
            self.on_done(self)
        self.event.set()

    def deliver(self, status: Status, value: Any) -> None:
        """The reply arrived (reader thread)."""
        if self.abandoned:
            if self.on_abandoned is not None:
                self.on_abandoned(status, value)
            return
        self.finish(status, value)

    def data(self, offset: int, payload: memoryview) -> None:
        if self.sink is not None:
            self.sink(offset, payload)
            self.received += len(payload)


class WaitMixin:
    """Waited messages and replies: the half of `rgpu.session.Session` that blocks (a mixin
    over the session's queue, stream core and counters)."""

    def request(
        self,
        msg: tuple,
        sink: Callable[[int, memoryview], None] | None = None,
        *,
        on_abandoned: Callable[[Status, Any], None] | None = None,
        progress: TransferProgress | None = None,
        device: int | None = None,
    ) -> Any:
        """Queue a waited message, send everything, and block until its reply.

        Ctrl-C returns at once; the reply, when it comes, goes to `on_abandoned` (so, e.g., the
        outputs of an abandoned data-dependent op get freed) and the session stays usable.
        """
        self.check_async_error()
        waiter = self.request_async(msg, sink, device=device)
        waiter.on_abandoned = on_abandoned
        return self.wait_for(waiter, progress)

    def request_async(
        self,
        msg: tuple,
        sink: Callable[[int, memoryview], None] | None = None,
        *,
        on_done: Callable[[Waiter], None] | None = None,
        detached: bool = False,
        device: int | None = None,
        send: bool = True,
    ) -> Waiter:
        """Queue a waited message and send everything, without waiting: the reply fills the
        returned Waiter (non-blocking readback, events). `send=False` leaves it queued, for a
        request that another, sent right after, carries along (one frame and one wake-up of the
        writer thread instead of two).

        `on_done` runs on the reader thread as the reply lands. A `detached` waiter is one that
        nobody may ever wait for: a lost connection does not wake it, its reply is still routed.
        """
        waiter = Waiter(sink, on_done)
        if self.uploads._unsettled:
            self.uploads.settle()
        with self.lock:
            self.check_usable()
            self.replay.end()  # a wait ends the segment: held ops go out first
            self._drain_frees_locked()  # so a waited INFO sees memory the client already let go
            if device is not None and device != self.wire_device:
                self.to_device_locked(device)  # this server's device `device` answers
            data = self._encode(msg)
            waiter.seq = self.stream.append_waited(data, waiter)
            self.bytes_out += len(data)
            self.messages += 1
            if send:
                self.flush_locked()
        return waiter

    def wait_for(self, waiter: Waiter, progress: TransferProgress | None = None) -> Any:
        """Block until `waiter` has its reply (one wait, unless it is already there)."""
        if not waiter.event.is_set():
            self.waits += 1
            if self.record_sites:  # which line waits, for the notebook's per-cell advice
                self.sites.note_wait()
            t0 = time.perf_counter()
            try:
                self._wait(waiter, progress)
            finally:
                self.wait_seconds += time.perf_counter() - t0
        status = waiter.status
        if status is Status.OK:
            return waiter.value
        if status is Status.ERROR:
            if getattr(self.async_error, "rgpu_seq", None) == waiter.seq:
                self.async_error = None  # reported here, not again at the next wait
            raise self.remote_error(waiter.value)
        if status is None:  # woken by a lost connection
            self.check_usable()
        raise ProtocolViolation(f"the rgpu server could not understand this client: {waiter.value}")

    def _wait(self, waiter: Waiter, progress: TransferProgress | None) -> None:
        try:
            while not waiter.event.wait(0.1):
                if self.broken is not None:
                    self.stream.forget(waiter.seq)
                    self.check_usable()
                if progress is not None:
                    progress.update_to(waiter.received)
        except KeyboardInterrupt as e:  # Ctrl-C: stop waiting, and stop the server's queued work
            waiter.abandoned = True
            self.interrupted(e)
            shown_briefly(e)  # in IPython: the user's lines, not rgpu's and torch's, and the note
            raise
        except BaseException:
            waiter.abandoned = True
            raise
        finally:
            if progress is not None:
                progress.close()

    def interrupted(self, exc: BaseException | None = None) -> int:
        """Ctrl-C: the server skips the work it has not started (those ops' outputs then say
        they were cancelled); how many messages that may be. The running op finishes."""
        try:
            with self.lock:
                self.replay.end()
                self.flush_locked()
                upto = self.stream.next_seq - 1
                queued = upto - self.stream.acked
                if queued > 0:
                    self.send(cancel_frame(upto))
        except RgpuError:
            return 0
        if queued > 0 and exc is not None and hasattr(exc, "add_note"):
            exc.add_note(
                f"rgpu: the server skips the work of up to {queued} queued message(s) it has not "
                "started (their results raise 'cancelled' if used); the op it is running finishes"
            )
        return max(queued, 0)

    def synchronize(self, device: int | None = None) -> None:
        """Wait until the server has run everything sent so far (one wait); raise a failure of
        a non-blocking readback sent before, which has landed by then (replies come in order).
        `device`: the server's device to synchronize (None: the one the last message ran on)."""
        self.request((Kind.SYNC,), device=device)
        self.check_async_error()

    def check_async_error(self) -> None:
        """A non-blocking readback that failed reports at the next wait, once (as CUDA does)."""
        if self.async_error is not None:
            error, self.async_error = self.async_error, None
            raise error

    def remote_error(self, value: Any) -> RemoteError:
        """The RemoteError an ERROR reply's [op, message, failed message's seq] describes,
        naming where that op was queued when sites are recorded."""
        op, message, *rest = value
        seq = rest[0] if rest and type(rest[0]) is int and rest[0] > 0 else None
        index = rest[1] if len(rest) > 1 and type(rest[1]) is int else None  # op of a REPLAY
        return RemoteError(str(op), str(message), seq, self.sites.site(seq, index))

    def note_async_error(self, waiter: Waiter) -> None:
        """Keep the first failure of a reply nobody waited for, to raise at the next wait."""
        if self.async_error is None:
            error = self.remote_error(waiter.value)
            error.rgpu_seq = waiter.seq
            self.async_error = error

    def _on_frame(self, frame: bytes) -> None:
        """Reader thread: route one server frame through the stream core."""
        if frame[:1] == PEEK_REPLY:  # out of band, outside the stream (rgpu.peek)
            self.peeks.answered(frame)
            return
        with self._core:
            event = self.stream.receive(frame)
            kind = type(event)
            if kind is not Data:
                self._confirmations.notify_all()
        if kind is Reply:
            self.bytes_in += len(frame)
            self.confirmed(event.uploads)
            if event.waiter is not None:
                event.waiter.deliver(event.status, event.value)
        elif kind is Data:
            self.bytes_in += len(frame)
            if event.waiter is not None:
                event.waiter.data(event.offset, event.payload)
        elif kind is Acked:
            self.confirmed(event.uploads)
        elif kind is Failed:
            self.bytes_in += len(frame)
            self.mark_broken(
                ProtocolViolation(f"the server reported a protocol error: {event.message}")
            )

    def confirmed(self, uploads: tuple) -> None:
        """The server has these chunked uploads whole: their sources are free to change."""
        for upload in uploads:
            upload.done.set()

    def mark_broken(self, exc: BaseException) -> None:
        if self.broken is None:
            self.broken = exc
        for w in self.stream.waiters():
            if w.on_done is None:  # detached waiters are not woken: nobody waits on them
                w.event.set()
