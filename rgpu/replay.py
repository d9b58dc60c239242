"""What the client keeps so a dropped connection loses nothing: messages the server has not
acknowledged, in order, ready to be sent again on a new connection.

The server acknowledges by answering a waited message (every message before it was applied) and
with ACK frames now and then. Past `limit` bytes unacknowledged, the client waits for the server
to catch up (flow control), so the buffer stays bounded without ever dropping what a resume needs.
Large uploads are kept by reference to their source tensor, not copied; if that tensor was
changed in place before a replay, the replay cancels the upload and its destination is poisoned,
rather than sending different bytes.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class ChunkedUpload:
    """The source of a chunked UPLOAD: replayed by sending its chunks again."""

    src: torch.Tensor
    version: int
    nbytes: int
    writer: Any = None  # the FrameWriter that last queued its chunks...
    ticket: int = 0  # ...and the ticket of its last chunk
    done: threading.Event = field(default_factory=threading.Event)  # acknowledged by the server

    def unchanged(self) -> bool:
        return self.src._version == self.version


class ReplayBuffer:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._cv = threading.Condition()
        self._entries: collections.deque[tuple[int, bytes, ChunkedUpload | None]] = (
            collections.deque()
        )
        self.bytes = 0
        self.acked = 0  # highest sequence number the server confirmed applied

    def add(
        self, first_seq: int, messages: list[bytes], upload: ChunkedUpload | None = None
    ) -> None:
        """Keep messages first_seq, first_seq + 1, ...; `upload` belongs to the last one."""
        with self._cv:
            last = len(messages) - 1
            for i, data in enumerate(messages):
                seq = first_seq + i
                if seq > self.acked:
                    self._entries.append((seq, data, upload if i == last else None))
                    self.bytes += len(data)

    def ack(self, seq: int) -> None:
        """The server applied everything up to `seq`: forget it."""
        with self._cv:
            if seq <= self.acked:
                return
            self.acked = seq
            entries = self._entries
            while entries and entries[0][0] <= seq:
                _, data, upload = entries.popleft()
                self.bytes -= len(data)
                if upload is not None:
                    upload.done.set()
            self._cv.notify_all()

    def over_limit(self) -> bool:
        return self.bytes > self.limit

    def wait_below_limit(self, timeout: float) -> bool:
        with self._cv:
            if self.bytes > self.limit:
                self._cv.wait(timeout)
            return self.bytes <= self.limit

    def pending(self) -> list[tuple[int, bytes, ChunkedUpload | None]]:
        """Everything not yet acknowledged, oldest first."""
        with self._cv:
            return list(self._entries)

    def __len__(self) -> int:
        return len(self._entries)
