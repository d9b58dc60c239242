"""A waited message's reply, as the reader thread delivers it to whoever waits for it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from rgpu_protocol import Status


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
