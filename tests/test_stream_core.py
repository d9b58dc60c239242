"""The op stream's two ends as state machines, with no server, socket or thread: numbering,
batching, confirmation, reply routing, and resuming after a cut at any point.

`Link` below plays the network between a `ClientStream` and a `ServerStream`: frames in flight
each way, delivered when the test says so, all lost at a cut. After a cut the client resumes
from what the server says it applied, exactly as the real I/O layers do (rgpu.reconnect and
rgpu_server.session), and the server's record of applied messages must come out whole, in order,
each exactly once, with every waited message answered once.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rgpu_protocol as p
from rgpu_protocol.client_stream import (
    FIRST,
    FULL,
    QUEUED,
    Acked,
    ClientStream,
    Data,
    Failed,
    Reply,
    SendChunks,
)
from rgpu_protocol.server_stream import (
    ACK_EVERY_MESSAGES,
    REPLY_CACHE,
    Action,
    Incoming,
    ServerStream,
    UploadAborted,
)

ENCODE = p.Encoder().encode


def incoming(server: ServerStream, frame: bytes):
    """The server's messages of a frame as `Incoming` (the hot path yields plain tuples)."""
    for m in server.messages(frame):
        yield Incoming(*m)


def run_msg(i: int) -> bytes:
    return ENCODE([p.Kind.RUN, "add.Tensor", [p.Ref(i)], None, [i + 1000]])


def waited_msg() -> bytes:
    return ENCODE([p.Kind.SYNC])


def upload_msg(nbytes: int) -> bytes:
    return ENCODE([p.Kind.UPLOAD, p.Ref(1), [torch.uint8, [nbytes], nbytes]])


class Upload:
    """A chunked upload's source, as the client keeps it for a resume."""

    def __init__(self, data: bytes, chunk: int) -> None:
        self.data = data
        self.chunk = chunk

    def frames(self, seq: int) -> list[bytes]:
        return [
            b"".join(p.chunk_frame(p.Frame.CHUNK, seq, off, self.data[off : off + self.chunk]))
            for off in range(0, len(self.data), self.chunk)
        ]


class Link:
    def __init__(self, flush_ops: int = 4, max_message: int = 1 << 16) -> None:
        self.client = ClientStream(flush_ops=flush_ops, flush_bytes=1 << 20,
                                   max_message=max_message, replay_limit=1 << 20)  # fmt: skip
        self.server = ServerStream()
        self.up: list[bytes] = []  # frames on their way to the server
        self.down: list[bytes] = []  # ...and to the client
        self.applied: list[tuple[int, list]] = []
        self.uploaded: dict[int, bytes] = {}  # seq -> bytes the server received for it
        self.answers: dict[int, list] = {}  # seq -> replies routed to its waiter
        self.waited: set[int] = set()
        self.expected: list[int] = []  # every message's seq, in order
        self._chunks: dict | None = None

    # -- the client side --------------------------------------------------------------------------

    def post(self, waited: bool = False) -> int:
        seq = self.client.next_seq
        if waited:
            self.client.append_waited(waited_msg(), ("waiter", seq))
            self.waited.add(seq)
        else:
            self.client.append(run_msg(seq))
        self.expected.append(seq)
        return seq

    def flush(self, upload: Upload | None = None, interrupted: bool = False) -> None:
        while (batch := self.client.batch(upload)) is not None:
            self.up.append(batch.frame)
            if interrupted:  # Ctrl-C between the send and its record: it goes out again later
                return
            self.client.sent(batch)

    def upload(self, data: bytes, chunk: int = 7) -> int:
        seq = self.client.next_seq
        self.client.append(upload_msg(len(data)))
        self.expected.append(seq)
        up = Upload(data, chunk)
        self.flush(up)
        self.up.extend(up.frames(seq))
        return seq

    def to_client(self, n: int | None = None) -> None:
        while self.down and (n is None or n > 0):
            event = self.client.receive(self.down.pop(0))
            if type(event) is Reply and event.waiter is not None:
                self.answers.setdefault(event.waiter[1], []).append(event.value)
            n = None if n is None else n - 1

    # -- the server side --------------------------------------------------------------------------

    def to_server(self, n: int | None = None) -> None:
        while self.up and (n is None or n > 0):
            frame = self.up.pop(0)
            n = None if n is None else n - 1
            if self._chunks is not None:
                seq, keep = self._chunks
                try:
                    _, payload, last = self.server.chunk(frame)
                except UploadAborted:
                    self._chunks = None
                    continue
                if keep:
                    self.uploaded[seq] = self.uploaded.get(seq, b"") + bytes(payload)
                if last:
                    self._chunks = None
                    if keep:  # an upload is applied once its last chunk is in
                        self.applied.append((seq, "upload"))
            else:
                for m in incoming(self.server, frame):
                    if m.action is Action.RUN and not self.server.chunks_wanted:
                        self.applied.append((m.seq, m.msg))
                        if m.msg[0] in p.WAITED:
                            self.down += self.server.reply(m.seq, p.Status.OK, m.seq)
                    elif m.action is Action.RESEND:
                        self.down += m.frames
                    if self.server.chunks_wanted:
                        self._chunks = (m.seq, m.action is Action.RUN)
            ack = self.server.ack_due(idle=not self.up)
            if ack is not None:
                self.down.append(ack)

    def cut(self) -> None:
        """The connection drops: what was in flight is lost; the client resumes."""
        self.up.clear()
        self.down.clear()
        self.server.abandon_chunks()
        if self._chunks is not None:
            self.uploaded.pop(self._chunks[0], None)
            self._chunks = None
        for item in self.client.resume(self.server.last_seq):
            if type(item) is SendChunks:
                self.up.extend(item.upload.frames(item.seq))
            else:
                self.up.append(item)

    def settle(self) -> None:
        self.flush()
        for _ in range(4):
            self.to_server()
            self.to_client()

    def check(self) -> None:
        assert [seq for seq, _ in self.applied] == self.expected  # in order, each exactly once
        for seq in self.waited:
            assert self.answers.get(seq) == [seq], f"message {seq}: {self.answers.get(seq)}"


# -- the client alone ---------------------------------------------------------------------------


def test_messages_are_numbered_by_position_and_batched_by_count():
    c = ClientStream(flush_ops=3)
    assert [c.append(run_msg(i)) for i in range(3)] == [FIRST, QUEUED, FULL]
    batch = c.batch()
    reader = p.BatchReader(batch.frame)
    assert reader.first_seq == 1 and len(list(reader)) == 3
    assert c.next_seq == 4 and c.first_seq == 1  # nothing changes until it is recorded as sent
    c.sent(batch)
    assert (c.first_seq, c.pending, c.unacked_bytes) == (4, 0, batch.nbytes)
    assert c.batch() is None


def test_a_batch_never_exceeds_a_message_and_a_large_message_goes_after_the_queue():
    c = ClientStream(flush_ops=1000, flush_bytes=1 << 30, max_message=200_000)
    for i in range(20):
        c.append(ENCODE([p.Kind.RUN, "add.Tensor", [bytes(3000)], None, [i]]))
    big = ENCODE([p.Kind.RUN, "add.Tensor", [bytes(150_000)], None, [1]])
    c.append(big)
    first = c.batch()
    assert len(first.messages) == 20 and big not in first.messages
    c.sent(first)
    second = c.batch()
    assert second.messages == [big] and second.first_seq == 21
    with pytest.raises(p.EncodeError, match="over the server's 200000-byte message limit"):
        c.append(ENCODE([p.Kind.RUN, "x.y", [bytes(250_000)], None, []]))


def test_acks_drop_whole_batches_and_stale_or_excessive_acks_do_no_harm():
    c = ClientStream(flush_ops=2)
    for i in range(6):
        c.append(run_msg(i))
        if c.pending == 2:
            c.sent(c.batch())
    assert len(c._unacked) == 3
    c.ack(3)  # inside the second batch: only the first is dropped
    assert len(c._unacked) == 2 and c.acked == 3
    c.ack(2)  # out of order: ignored
    c.ack(3)  # duplicate: ignored
    assert len(c._unacked) == 2 and c.acked == 3
    c.ack(10**9)  # a server cannot have applied what was never sent
    assert c.acked == 6 and c.unacked_bytes == 0 and not c._unacked


def test_replies_and_data_reach_their_waiter_and_unknown_ones_reach_nobody():
    c = ClientStream()
    seq = c.append_waited(waited_msg(), "mine")
    c.sent(c.batch())
    data = c.receive(b"".join(p.chunk_frame(p.Frame.DATA, seq, 0, b"abc")))
    assert type(data) is Data and data.waiter == "mine" and bytes(data.payload) == b"abc"
    reply = c.receive(p.reply_frame(ENCODE, seq, p.Status.OK, 3))
    assert type(reply) is Reply and (reply.waiter, reply.value) == ("mine", 3)
    again = c.receive(p.reply_frame(ENCODE, seq, p.Status.OK, 3))
    assert again.waiter is None  # a resent reply after it was answered: routed nowhere
    assert type(c.receive(p.ack_frame(1))) is Acked
    failed = c.receive(p.reply_frame(ENCODE, 0, p.Status.PROTOCOL, "no"))
    assert type(failed) is Failed and failed.message == "no"
    with pytest.raises(p.ProtocolError):
        c.receive(bytes((p.Frame.BATCH,)))


def test_an_interrupted_send_goes_out_again_under_the_same_numbers():
    link = Link()
    for _ in range(3):
        link.post()
    link.flush(interrupted=True)  # sent, but not recorded
    link.post(waited=True)
    link.flush()  # carries messages 1-3 again, then 4
    link.to_server()
    link.to_client()
    link.check()


# -- the server alone ---------------------------------------------------------------------------


def test_the_server_refuses_a_gap_and_skips_or_answers_what_it_applied_before():
    s = ServerStream()
    frame = p.batch_frame(1, [run_msg(1), waited_msg()])
    assert [m.action for m in incoming(s, frame)] == [Action.RUN, Action.RUN]
    s.reply(2, p.Status.OK, "first answer")
    again = list(incoming(s, frame))
    assert [m.action for m in again] == [Action.SKIP, Action.RESEND]
    assert p.parse_reply(again[1].frames[-1])[2] == "first answer"
    with pytest.raises(p.ProtocolError, match="sequence gap: expected 3, got 5"):
        list(s.messages(p.batch_frame(5, [run_msg(5)])))


def test_a_message_counts_as_applied_only_once_the_caller_moves_past_it():
    s = ServerStream()
    messages = s.messages(p.batch_frame(1, [run_msg(1), run_msg(2)]))
    next(messages)
    assert s.last_seq == 0  # still running (or failed mid-way): not applied
    next(messages)
    assert s.last_seq == 1


def test_a_lost_reply_that_is_no_longer_kept_is_answered_with_an_error():
    s = ServerStream()
    frames = [waited_msg() for _ in range(REPLY_CACHE + 1)]
    for m in incoming(s, p.batch_frame(1, frames)):
        s.reply(m.seq, p.Status.OK, m.seq)
    first = list(incoming(s, p.batch_frame(1, frames[:1])))[0]
    seq, status, value = p.parse_reply(first.frames[-1])
    assert (seq, status) == (1, p.Status.ERROR) and "no longer kept" in value[1]


def test_chunks_must_continue_their_upload_and_the_last_one_applies_it():
    s = ServerStream()
    [m] = incoming(s, p.batch_frame(1, [upload_msg(10)]))
    assert m.action is Action.RUN and m.nbytes == 10 and s.chunks_wanted and s.last_seq == 0
    chunks = Upload(bytes(range(10)), 4).frames(1)
    with pytest.raises(p.ProtocolError, match="does not continue UPLOAD 1"):
        s.chunk(chunks[1])
    assert s.chunk(chunks[0])[2] is False
    s.chunk(chunks[1])
    offset, payload, last = s.chunk(chunks[2])
    assert (offset, bytes(payload), last, s.last_seq) == (8, bytes([8, 9]), True, 1)
    with pytest.raises(p.ProtocolError, match="no UPLOAD announced"):
        s.chunk(chunks[0])


def test_an_aborted_upload_is_applied_as_interrupted_and_a_late_abort_is_ignored():
    s = ServerStream()
    list(s.messages(p.batch_frame(1, [upload_msg(10)])))
    abort = b"".join(p.chunk_frame(p.Frame.CHUNK, 1, p.ABORT_OFFSET, b""))
    with pytest.raises(UploadAborted):
        s.chunk(abort)
    assert s.last_seq == 1 and not s.chunks_wanted
    assert list(s.messages(abort)) == []  # the upload is over: a repeated abort means nothing


def test_a_chunked_upload_must_end_its_batch_and_its_chunks_come_next():
    s = ServerStream()
    with pytest.raises(p.ProtocolError, match="last message of its batch"):
        list(s.messages(p.batch_frame(1, [upload_msg(4), run_msg(2)])))
    s = ServerStream()
    list(s.messages(p.batch_frame(1, [upload_msg(4)])))
    with pytest.raises(p.ProtocolError, match="expected a CHUNK"):
        list(s.messages(p.batch_frame(2, [run_msg(2)])))


def test_the_server_confirms_progress_every_so_many_messages_and_when_caught_up():
    s = ServerStream()
    batch = p.batch_frame(1, [run_msg(i) for i in range(ACK_EVERY_MESSAGES)])
    list(s.messages(batch))
    assert p.parse_ack(s.ack_due(idle=False)) == ACK_EVERY_MESSAGES
    assert s.ack_due(idle=True) is None  # nothing new since
    list(s.messages(p.batch_frame(ACK_EVERY_MESSAGES + 1, [run_msg(0)])))
    assert s.ack_due(idle=False) is None  # a little more, and more may come
    list(s.messages(p.batch_frame(ACK_EVERY_MESSAGES + 2, [run_msg(0)] * 2000)))
    assert p.parse_ack(s.ack_due(idle=True)) == ACK_EVERY_MESSAGES + 2001


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=64), max_size=6))
def test_hostile_frames_give_protocol_errors_only(frames):
    s = ServerStream()
    for frame in frames:
        try:
            if s.chunks_wanted:
                s.chunk(frame)
            else:
                list(s.messages(frame))
        except (p.ProtocolError, UploadAborted):
            s = ServerStream()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=10**6), max_size=10),
       st.lists(st.binary(max_size=40), max_size=5))  # fmt: skip
def test_hostile_server_frames_give_protocol_errors_only(acks, frames):
    c = ClientStream()
    for i in range(5):
        c.append(run_msg(i))
    c.sent(c.batch())
    for a in acks:
        c.receive(p.ack_frame(a))
    for frame in frames:
        try:
            c.receive(frame)
        except p.ProtocolError:
            pass
    assert c.acked <= 5


# -- both ends, with cuts -----------------------------------------------------------------------


def test_a_cut_at_every_point_of_a_stream_loses_and_repeats_nothing():
    """Message i's frames are lost at every possible position: before the server saw them,
    after it applied some, after it answered but before the reply came back."""
    plan = [False, True, False, False, True, False, True, True, False]
    for cut_after_server in range(0, 6):
        for cut_after_client in range(0, 4):
            link = Link(flush_ops=2)
            for waited in plan:
                link.post(waited)
                if waited:
                    link.flush()
            link.flush()
            link.to_server(cut_after_server)
            link.to_client(cut_after_client)
            link.cut()
            link.settle()
            link.check()


def test_uploads_cut_midway_arrive_whole_once():
    for cut_at in range(0, 8):
        link = Link()
        link.post()
        seq = link.upload(bytes(range(20)), chunk=4)  # 1 batch + 5 chunk frames
        link.post(waited=True)
        link.flush()
        link.to_server(cut_at)
        link.cut()
        link.settle()
        link.check()
        assert link.uploaded[seq] == bytes(range(20))


STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("post"), st.booleans()),
        st.tuples(st.just("flush"), st.booleans()),
        st.tuples(st.just("upload"), st.integers(min_value=0, max_value=30)),
        st.tuples(st.just("server"), st.integers(min_value=0, max_value=4)),
        st.tuples(st.just("client"), st.integers(min_value=0, max_value=4)),
        st.tuples(st.just("cut"), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(STEPS, st.integers(min_value=1, max_value=6))
def test_any_interleaving_of_sends_deliveries_and_cuts_applies_each_message_once(steps, ops):
    link = Link(flush_ops=ops)
    uploads: dict[int, bytes] = {}
    for what, arg in steps:
        if what == "post":
            link.post(waited=arg)
        elif what == "flush":
            link.flush(interrupted=arg)
        elif what == "upload":
            data = bytes((arg + i) % 256 for i in range(arg))
            uploads[link.upload(data, chunk=5)] = data
        elif what == "server":
            link.to_server(arg)
        elif what == "client":
            link.to_client(arg)
        else:
            link.cut()
    link.settle()
    link.cut()  # whatever is still unconfirmed goes again
    link.settle()
    link.check()
    for seq, data in uploads.items():
        assert link.uploaded.get(seq, b"") == data
