"""What the client keeps so a dropped connection loses nothing: messages the server has not
acknowledged, in order, ready to be sent again on a new connection.

The server acknowledges by answering a waited message (every message before it was applied) and
with ACK frames now and then. Past `limit` bytes unacknowledged, the client waits for the server
to catch up (flow control), so the buffer stays bounded without ever dropping what a resume needs.
Messages are kept a batch at a time (as they were sent), so keeping them costs the hot path
nothing per message. Large uploads are kept by reference to their source tensor, not copied; if
that tensor was changed in place before a replay, the replay cancels the upload and its
destination is poisoned, rather than sending different bytes.
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
        # (first_seq, messages, nbytes, upload of the last message or None), oldest first
        self._batches: collections.deque[tuple[int, list[bytes], int, ChunkedUpload | None]] = (
            collections.deque()
        )
        self.bytes = 0
        self.acked = 0  # highest sequence number the server confirmed applied

    def add(
        self,
        first_seq: int,
        messages: list[bytes],
        nbytes: int,
        upload: ChunkedUpload | None = None,
    ) -> None:
        """Keep a sent batch: messages first_seq, first_seq + 1, ...; `upload` is its last."""
        with self._cv:
            self._batches.append((first_seq, messages, nbytes, upload))
            self.bytes += nbytes

    def ack(self, seq: int) -> None:
        """The server applied everything up to `seq`: forget whole batches up to there."""
        with self._cv:
            if seq <= self.acked:
                return
            self.acked = seq
            batches = self._batches
            while batches and batches[0][0] + len(batches[0][1]) - 1 <= seq:
                _, _, nbytes, upload = batches.popleft()
                self.bytes -= nbytes
                if upload is not None:
                    upload.done.set()
            self._cv.notify_all()

    def wait_below_limit(self, timeout: float) -> bool:
        with self._cv:
            if self.bytes > self.limit:
                self._cv.wait(timeout)
            return self.bytes <= self.limit

    def pending(self) -> list[tuple[int, bytes, ChunkedUpload | None]]:
        """Every message not yet acknowledged, oldest first, as (seq, bytes, upload)."""
        with self._cv:
            out = []
            for first, messages, _, upload in self._batches:
                last = len(messages) - 1
                for i, data in enumerate(messages):
                    if first + i > self.acked:
                        out.append((first + i, data, upload if i == last else None))
            return out

    def __len__(self) -> int:
        return len(self._batches)
