"""Replies from a session's worker thread to its websocket, written by the event loop in order.

Why: the worker used to hand each reply to the loop as a coroutine (`run_coroutine_threadsafe`:
a task, a future chained across threads, the websocket's async send context) and block until it
was written: a thread hand-off per reply, and on this 2-core machine 490 µs of the server's CPU
per `synchronize()` round trip, 395 µs with this (the round trip's wall time, which the client's
threads set, did not move). Here the worker queues the frames with one
`call_soon_threadsafe` and goes on; the loop writes them at once through the websocket's sans-I/O
protocol when nothing is in the way (no fragmented send in progress, the transport not paused,
the connection open, no frame given as a list of parts), else in order through the websocket's
own `send`, which sends a list as one fragmented message and waits for the transport to drain.

The worker blocks only while more than `limit` bytes are queued and not yet written: a client
that stops reading still holds the worker back, as before. A close the server makes waits for
`flushed` first, so the replies the worker queued before it go out before the close.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from typing import Any

from websockets.protocol import State

LIMIT = 8 << 20  # bytes queued and not yet written before the worker waits


def _can_write_directly(ws: Any) -> bool:
    """The websocket exposes what the direct write needs (websockets' asyncio Connection)."""
    return all(hasattr(ws, a) for a in ("protocol", "send_data", "paused", "send_in_progress"))


class Outbox:
    """One connection's queue of outgoing frames. `send` is called from the worker thread."""

    def __init__(self, ws: Any, loop: asyncio.AbstractEventLoop, limit: int = LIMIT) -> None:
        self._ws = ws
        self._loop = loop
        self._limit = limit
        self._direct = _can_write_directly(ws)
        self._cond = threading.Condition()
        self._queued = 0  # bytes handed to the loop and not yet written (or dropped)
        self._waiting = False
        self._backlog: deque = deque()  # frames behind a slow send, in order (loop thread only)
        self._drain_task: asyncio.Task | None = None  # held: the loop keeps only a weak ref

    def send(self, frames: list) -> None:
        size = sum(len(f) if type(f) is not list else sum(map(len, f)) for f in frames)
        with self._cond:
            self._queued += size
        try:
            self._loop.call_soon_threadsafe(self._write, frames, size)
        except RuntimeError:  # the loop is closed: the server is going away
            self._written(size)
            return
        if self._queued > self._limit:
            with self._cond:
                self._waiting = True
                while self._queued > self._limit and not self._loop.is_closed():
                    self._cond.wait(0.5)
                self._waiting = False

    async def flushed(self, timeout: float) -> None:
        """Wait, on the loop, until every frame handed over is written or dropped (a shutdown
        closes the connection only after the replies to the work it let finish)."""
        deadline = time.monotonic() + timeout
        while self._queued > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    def _written(self, size: int) -> None:
        with self._cond:
            self._queued -= size
            if self._waiting:
                self._cond.notify_all()

    def _write(self, frames: list, size: int) -> None:  # on the loop
        ws = self._ws
        if (
            not self._direct
            or self._backlog
            or ws.send_in_progress is not None
            or ws.paused
            or ws.protocol.state is not State.OPEN
            or any(type(f) is list for f in frames)  # a fragmented message: the slow path
        ):
            self._backlog.append((frames, size))
            if self._drain_task is None or self._drain_task.done():
                self._drain_task = self._loop.create_task(self._drain())
            return
        try:
            for f in frames:
                ws.protocol.send_binary(f)
            ws.send_data()
        except OSError:
            pass  # the connection is going away; its reader detaches the session
        finally:
            self._written(size)

    async def _drain(self) -> None:
        while self._backlog:
            frames, size = self._backlog[0]
            try:
                for f in frames:
                    await self._ws.send(f)
            except Exception:
                pass  # as above: the connection is gone
            finally:
                self._backlog.popleft()
                self._written(size)
