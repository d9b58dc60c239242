"""The one thread that writes to the socket.

Ctrl-C (SIGINT, "interrupt kernel") is delivered to the main thread and can raise between any two
bytecodes, including inside a socket write; a frame torn in half would corrupt the stream for good.
So the main thread only queues frames and a dedicated thread writes them. Frames can be tagged and
withdrawn before they are written (a cancelled upload), and a writer can be waited on until a
given frame is out.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

MAX_QUEUED_BYTES = 64 << 20  # queue() blocks beyond this: memory stays bounded during uploads


class FrameWriter:
    def __init__(
        self,
        send: Callable[[bytes | list], None],
        on_error: Callable[[BaseException], None],
        transform: Callable[[bytes | list], bytes | list] | None = None,
    ) -> None:
        """`transform` gives the form a frame goes out in (compression); it runs on this thread,
        off the caller's path."""
        self._send = send
        self._transform = transform
        self._on_error = on_error
        self._cv = threading.Condition()
        # (ticket, tag, frame, nbytes, transform?)
        self._queue: collections.deque = collections.deque()
        self._queued_bytes = 0
        self._next_ticket = 1
        self.written = 0  # highest ticket written (or withdrawn)
        self.bytes_written = 0
        self.failed: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="rgpu-writer", daemon=True)
        self._thread.start()

    def queue(
        self, frame: bytes | list, nbytes: int, tag: object = None, transform: bool = False
    ) -> int:
        """Queue a frame; returns its ticket. Blocks while too many bytes are waiting.
        `transform`: the frame may go out in the form the writer's transform gives it."""
        with self._cv:
            while (
                self._queued_bytes > MAX_QUEUED_BYTES and self.failed is None and not self._closed
            ):
                self._cv.wait(0.1)
            ticket = self._next_ticket
            self._next_ticket += 1
            self._queue.append((ticket, tag, frame, nbytes, transform))
            self._queued_bytes += nbytes
            self._cv.notify_all()
        return ticket

    def withdraw(self, tag: object) -> int:
        """Remove queued, unwritten frames with this tag; returns how many were removed."""
        with self._cv:
            keep = collections.deque(item for item in self._queue if item[1] is not tag)
            removed = len(self._queue) - len(keep)
            for item in self._queue:
                if item[1] is tag:
                    self._queued_bytes -= item[3]
            self._queue = keep
            self._cv.notify_all()
        return removed

    def wait_written(self, ticket: int, timeout: float) -> bool:
        """True once the frame with `ticket` (and all before it) has been written."""
        with self._cv:
            if self.written < ticket and self.failed is None and not self._closed:
                self._cv.wait(timeout)
            return self.written >= ticket

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                ticket, _tag, frame, nbytes, transform = self._queue.popleft()
            try:
                if transform and self._transform is not None:
                    frame = self._transform(frame)
                self._send(frame)
            except BaseException as e:
                with self._cv:
                    self.failed = e
                    self._queue.clear()
                    self._queued_bytes = 0
                    self._cv.notify_all()
                self._on_error(e)
                return
            with self._cv:
                self._queued_bytes -= nbytes
                self.bytes_written += nbytes
                self.written = max(self.written, ticket)
                self._cv.notify_all()

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued (up to `timeout`), then stop."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if timeout and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
