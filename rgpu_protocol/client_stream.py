"""The client's end of the op stream as a state machine: no sockets, threads or clocks inside.

`ClientStream` numbers messages, groups them into BATCH frames, keeps every sent message until the
server confirms it applied it, routes the server's REPLY, DATA and ACK frames to whoever waits
for them, and, after a dropped connection, says what to send again on the new one. The I/O layer
(`rgpu.session`) feeds it the frames it reads and sends the frames it is given, under one lock;
nothing here blocks.

Sending is two steps, `batch()` then `sent(batch)`, so that a KeyboardInterrupt between any two
bytecodes of the caller can never lose a message: until `sent`, the messages stay queued and a
later batch carries them again under the same numbers (the server drops what it already applied).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

from .codec import DEFAULT_LIMITS
from .errors import EncodeError, ProtocolError
from .frames import Frame, batch_frame, parse_ack, parse_chunk, parse_reply
from .messages import Status

# what `append` tells the caller
QUEUED = 0  # nothing to do
FIRST = 1  # the queue was empty: something should send it if the client goes quiet
FULL = 2  # the queue reached its count or byte threshold: send it now

MESSAGE_SLACK = 64  # bytes a BATCH frame adds around its messages (kind byte, first seq)


@dataclass
class Batch:
    """Messages `first_seq`, `first_seq + 1`, ... as one BATCH frame."""

    first_seq: int
    messages: list[bytes]
    nbytes: int
    frame: bytes
    upload: Any = None  # the last message is a chunked UPLOAD: its chunks follow the frame
    data_bytes: int = 0  # inline tensor bytes among the messages (they do not compress)

    @property
    def last_seq(self) -> int:
        return self.first_seq + len(self.messages) - 1


@dataclass(frozen=True)
class Reply:
    seq: int
    status: Status
    value: Any
    waiter: Any  # what `expect` registered for seq, or None
    uploads: tuple = ()  # chunked uploads the server has now confirmed whole


@dataclass(frozen=True)
class Data:
    seq: int
    offset: int
    payload: memoryview
    waiter: Any


@dataclass(frozen=True)
class Acked:
    seq: int
    uploads: tuple = ()


@dataclass(frozen=True)
class Failed:
    """The server reported that it could not understand the stream; the session is over."""

    message: str


@dataclass(frozen=True)
class SendChunks:
    """Resume: send the chunks of the chunked UPLOAD `seq` again, right after the batch before."""

    seq: int
    upload: Any


class ClientStream:
    def __init__(
        self,
        *,
        flush_ops: int = 128,
        flush_bytes: int = 1 << 20,
        max_message: int = DEFAULT_LIMITS.max_message,
        replay_limit: int = 256 << 20,
    ) -> None:
        self.flush_ops = flush_ops
        self.flush_bytes = min(flush_bytes, max_message // 2)
        self.max_message = max_message
        self.replay_limit = replay_limit  # past this many unacknowledged bytes: wait (flow control)
        # the queue: messages first_seq, first_seq + 1, ... not yet sent. A message's number is
        # its position, never a separate counter.
        self._pending: list[bytes] = []
        self.pending_bytes = 0
        self._pending_data = 0
        self.first_seq = 1
        # sent but not confirmed: whole batches, oldest first
        self._unacked: collections.deque[Batch] = collections.deque()
        self.unacked_bytes = 0
        self.acked = 0  # highest sequence number the server confirmed applied
        self._waiters: dict[int, Any] = {}  # seq of a waited message -> whoever gets its reply
        self._unanswered: dict[int, bytes] = {}  # waited messages without a reply yet

    # -- the queue ----------------------------------------------------------------------------

    @property
    def next_seq(self) -> int:
        return self.first_seq + len(self._pending)

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def over_limit(self) -> bool:
        """Flow control: the server is far behind; the client should wait for ACKs."""
        return self.unacked_bytes > self.replay_limit

    def check_size(self, data: bytes) -> None:
        if len(data) > self.max_message - MESSAGE_SLACK:
            raise EncodeError(
                f"this op encodes to {len(data)} bytes, over the server's {self.max_message}-byte "
                "message limit; move large CPU tensors to rgpu first (x.to('rgpu')) instead of "
                "passing them as arguments"
            )

    def append(self, data: bytes, data_bytes: int = 0) -> int:
        """Queue one encoded message; QUEUED, FIRST or FULL. `data_bytes`: inline tensor bytes."""
        if len(data) > 65536:
            self.check_size(data)
        pending = self._pending
        pending.append(data)
        self.pending_bytes += len(data)
        if data_bytes:
            self._pending_data += data_bytes
        n = len(pending)
        if n >= self.flush_ops or self.pending_bytes >= self.flush_bytes:
            return FULL
        return FIRST if n == 1 else QUEUED

    def append_waited(self, data: bytes, waiter: Any) -> int:
        """Queue a message that gets a REPLY, routed to `waiter`; its sequence number."""
        self.append(data)
        seq = self.next_seq - 1
        self._waiters[seq] = waiter
        self._unanswered[seq] = data
        return seq

    def batch(self, upload: Any = None) -> Batch | None:
        """The queue's oldest messages as one frame, no larger than a message may be; None when
        the queue is empty. With `upload`, the queue ends with that chunked UPLOAD message.
        Nothing changes until `sent`."""
        pending = self._pending
        if not pending:
            return None
        count, size = len(pending), self.pending_bytes
        limit = self.max_message - MESSAGE_SLACK
        if size > limit:  # a large message joined a full queue: send what fits first
            count, size = 0, 0
            for data in pending:
                if count and size + len(data) > limit:
                    break
                count += 1
                size += len(data)
        messages = pending if count == len(pending) else pending[:count]
        whole = count == len(pending)
        return Batch(
            self.first_seq,
            messages,
            size,
            batch_frame(self.first_seq, messages),
            upload if whole else None,
            self._pending_data,
        )

    def sent(self, batch: Batch) -> None:
        """`batch` is on its way: keep it until the server confirms it, and dequeue it."""
        if batch.first_seq != self.first_seq:
            return  # already recorded (the caller was interrupted and tried again)
        n = len(batch.messages)
        self._unacked.append(batch)
        self.unacked_bytes += batch.nbytes
        rest = self._pending[n:]
        self.first_seq += n
        self._pending = rest
        self.pending_bytes -= batch.nbytes
        self._pending_data = self._pending_data if rest else 0

    # -- what the server sends ----------------------------------------------------------------

    def receive(self, frame: bytes) -> Reply | Data | Acked | Failed:
        """Route one frame from the server."""
        kind = frame[0] if frame else -1
        if kind == Frame.REPLY:
            seq, status, value = parse_reply(frame)
            if status is Status.PROTOCOL and seq == 0:
                return Failed(str(value))
            uploads = self.ack(seq)  # the server runs messages in order
            self._unanswered.pop(seq, None)
            return Reply(seq, status, value, self._waiters.pop(seq, None), uploads)
        if kind == Frame.DATA:
            seq, offset, payload = parse_chunk(frame)
            return Data(seq, offset, payload, self._waiters.get(seq))
        if kind == Frame.ACK:
            seq = parse_ack(frame)
            return Acked(seq, self.ack(seq))
        raise ProtocolError(f"unexpected frame kind {kind} from the server")

    def ack(self, seq: int) -> tuple:
        """The server applied everything up to `seq`; returns the chunked uploads now confirmed."""
        if seq <= self.acked:
            return ()
        # Past what was recorded as sent: a batch that went out just before an interrupt kept
        # its messages queued; they are confirmed when they go out again.
        seq = min(seq, self.first_seq - 1)
        if seq <= self.acked:
            return ()
        self.acked = seq
        done = []
        unacked = self._unacked
        while unacked and unacked[0].last_seq <= self.acked:
            b = unacked.popleft()
            self.unacked_bytes -= b.nbytes
            if b.upload is not None:
                done.append(b.upload)
        return tuple(done)

    # -- waiters --------------------------------------------------------------------------------

    def waiter(self, seq: int) -> Any:
        return self._waiters.get(seq)

    def forget(self, seq: int) -> Any:
        """Stop routing seq's reply to its waiter; returns the waiter."""
        return self._waiters.pop(seq, None)

    def waiters(self) -> list:
        return list(self._waiters.values())

    # -- after a dropped connection ------------------------------------------------------------

    def resume(self, applied: int) -> list[bytes | SendChunks]:
        """What to send on a new connection whose server applied everything up to `applied`:
        waited messages it applied but whose reply may be lost (it answers them again), then
        every message it lacks, in order, in batches, each chunked UPLOAD followed by its chunks.
        Queued messages are not included: they go out with the next batch, as usual."""
        applied = min(applied, self.first_seq - 1)
        self.ack(applied)
        out: list[bytes | SendChunks] = []
        for seq in sorted(self._unanswered):
            if seq <= applied:
                out.append(batch_frame(seq, [self._unanswered[seq]]))
        cap = min(self.flush_bytes, self.max_message - 1024)
        messages: list[bytes] = []
        size = first = 0
        for b in self._unacked:
            last = len(b.messages) - 1
            for i, data in enumerate(b.messages):
                seq = b.first_seq + i
                if seq <= applied:
                    continue
                if messages and size + len(data) > cap:
                    out.append(batch_frame(first, messages))
                    messages, size = [], 0
                if not messages:
                    first = seq
                messages.append(data)
                size += len(data)
                upload = b.upload if i == last else None
                if upload is not None or len(messages) >= self.flush_ops:
                    out.append(batch_frame(first, messages))
                    messages, size = [], 0
                    if upload is not None:
                        out.append(SendChunks(seq, upload))
        if messages:
            out.append(batch_frame(first, messages))
        return out
