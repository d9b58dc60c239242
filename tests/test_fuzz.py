"""Hostile input: the server's decoder and dispatcher under generated garbage.

In-process, a server `Session` (its real worker thread, no socket) gets hypothesis-generated
frames: malformed, truncated and oversized bytes, wrong field types, unknown and blocklisted ops,
ids it never made, negative and huge shapes. Whatever arrives, the session either answers a
following SYNC or ends with a protocol error; it never raises an internal error, crashes or hangs.
Over the network, a real server gets the same treatment and keeps serving its other sessions.
"""

from __future__ import annotations

import os
import queue
import struct

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rgpu_server.session import Session
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as ws_connect

import rgpu
import rgpu_protocol as p

LIMITS = p.Limits(max_message=1 << 20, max_chunk=1 << 16)
ENC = p.Encoder()
CASES = {"in_process": 0, "network": 0}
IN_PROCESS_EXAMPLES = 400
NETWORK_EXAMPLES = 60


class Harness:
    """One server session, fed frames directly; its replies land in a queue."""

    def __init__(self) -> None:
        self.out: queue.Queue = queue.Queue()
        self.protocol_errors: list[str] = []
        self.session = Session(
            os.urandom(16), torch.device("cpu"), LIMITS, client="fuzz", quota=64 << 20
        )
        self.gen = self.session.attach(
            lambda frames: [self.out.put(f) for f in frames], self.protocol_errors.append
        )
        # a few real tensors, ids 1..3, so that some generated references resolve
        self.send(p.batch_frame(1, [
            ENC.encode([p.Kind.RUN, "ones.default", [[4]], {"device": p.Device("rgpu")}, [1]]),
            ENC.encode([p.Kind.RUN, "arange.default", [6], {"device": p.Device("rgpu")}, [2]]),
            ENC.encode([p.Kind.RUN, "zeros.default", [[2, 3]], {"dtype": torch.int32, "device": p.Device("rgpu")}, [3]]),
        ]))  # fmt: skip

    def send(self, frame: bytes) -> None:
        self.session.put(self.gen, frame)

    def settle(self) -> None:
        """Check the session survived: a SYNC gets an answer, or it ended with a protocol error."""
        s = self.session
        for _ in range(2000):
            if s.idle() or s.ended:
                break
            import time

            time.sleep(0.005)
        assert s.idle() or s.ended, "the session hangs on this input"
        replies = self._drain()
        for _kind, status, value in replies:
            assert not (status == p.Status.PROTOCOL and "internal server error" in str(value)), (
                value
            )
        if s.ended:
            assert self.protocol_errors, "a session may only end with a protocol error"
            return
        seq = s.last_seq + 1
        self.send(p.batch_frame(seq, [ENC.encode([p.Kind.SYNC])]))
        deadline = 10.0
        while True:
            frame = self.out.get(timeout=deadline)
            if frame[0] == p.Frame.REPLY:
                rseq, status, value = p.parse_reply(frame)
                if rseq == seq:
                    assert status in (p.Status.OK, p.Status.ERROR), value
                    return
                assert not (
                    status == p.Status.PROTOCOL and "internal server error" in str(value)
                ), value
                if status == p.Status.PROTOCOL:
                    return  # the SYNC itself hit a protocol problem left by the garbage

    def _drain(self) -> list:
        got = []
        while True:
            try:
                frame = self.out.get_nowait()
            except queue.Empty:
                return got
            if frame and frame[0] == p.Frame.REPLY:
                got.append(p.parse_reply(frame))

    def close(self) -> None:
        self.session.stop()
        self.session.join(10)


# -- generated values -------------------------------------------------------------------------

ints = st.sampled_from(
    [-(2**63), -(2**31), -1, 0, 1, 2, 3, 7, 2**31, 2**62, 2**63 - 1]
) | st.integers(-5, 64)
names = st.sampled_from([
    "add.Tensor", "mm.default", "mul.Scalar", "empty.memory_format", "ones.default", "zeros.default",
    "view.default", "as_strided.default", "resize_.default", "index.Tensor", "cat.default", "sum.default",
    "from_file.default", "_print.default", "nonexistent.default", "add", "", "__import__.os", "aten::add.Tensor",
    "os.system", "_efficientzerotensor.default", "set_.source_Storage", "copy_.default", "nonzero.default",
    "Add.Tensor", "add.Tensor.x", "add.__call__",
]) | st.text(max_size=12)  # fmt: skip


def ext_payloads():
    raw = st.binary(max_size=40)
    return st.one_of(
        st.builds(lambda c, d: msgpack.ExtType(c, d), st.sampled_from([1, 2, 3, 4, 5, 6, 7, 8, 9, 42]), raw),
        st.builds(lambda i: p.ref_ext(i), st.sampled_from([1, 2, 3, 4, 999, 2**63])),
        st.builds(lambda b, n: p.view_ext(b, tuple([n] * 2), (1, 1), 0), st.sampled_from([1, 2, 3, 77]), ints),
        st.builds(lambda d, s: msgpack.ExtType(6, bytes([d, len(s)]) + struct.pack(f"<{len(s)}q", *s) + b"\0" * 8),
                  st.integers(0, 30), st.lists(st.integers(-3, 4), max_size=3)),
        st.sampled_from([p.codec.DTYPE_EXT[torch.float32], p.codec.DTYPE_EXT[torch.int64]]),
        st.sampled_from([ENC.encode(p.Device(n)) for n in ("rgpu", "cpu", "cuda:7", "meta", "x")]).map(msgpack.unpackb),
    )  # fmt: skip


values = st.recursive(
    st.none() | st.booleans() | ints | st.floats(allow_nan=True) | st.text(max_size=8) | st.binary(max_size=8) | ext_payloads(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=12,
)  # fmt: skip

kinds = st.sampled_from([int(k) for k in p.Kind]) | st.integers(-3, 40)


@st.composite
def messages(draw):
    kind = draw(kinds)
    shape = draw(st.sampled_from(["run", "free", "upload", "download", "random"]))
    if shape == "run":
        return [kind, draw(names), draw(st.lists(values, max_size=4)), draw(st.none() | st.dictionaries(st.text(max_size=8), values, max_size=3)),
                draw(st.lists(st.none() | ints | st.text(max_size=2), max_size=3))]  # fmt: skip
    if shape == "free":
        return [kind, draw(st.lists(ints | st.text(max_size=2), max_size=5))]
    if shape == "upload":
        return [kind, draw(values), draw(st.lists(values, max_size=3) | values)]
    if shape == "download":
        return [kind, draw(values)]
    return draw(st.lists(values, max_size=6))


@st.composite
def frames(draw):
    how = draw(
        st.sampled_from(["batch", "batch", "batch", "bytes", "truncated", "chunk", "oversized"])
    )
    if how == "bytes":
        return draw(st.binary(max_size=200))
    if how == "chunk":
        return bytes([p.Frame.CHUNK]) + draw(st.binary(max_size=40))
    if how == "oversized":
        return p.batch_frame(4, [ENC.encode([p.Kind.SEED, 1])]) + b"\x90" * (LIMITS.max_message)
    seq = draw(st.sampled_from([1, 3, 4, 5, 100, 2**62]))
    msgs = [ENC.encode(m) for m in draw(st.lists(messages(), min_size=1, max_size=4))]
    frame = p.batch_frame(seq, msgs)
    if how == "truncated":
        frame = frame[: draw(st.integers(1, max(1, len(frame) - 1)))]
    return frame


@settings(max_examples=IN_PROCESS_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(frames(), min_size=1, max_size=3))
def test_generated_frames_never_crash_or_hang_a_session(batch):
    h = Harness()
    try:
        for frame in batch:
            h.send(frame)
        h.settle()
        CASES["in_process"] += 1
    finally:
        h.close()


@pytest.fixture(scope="module")
def honest(server):
    """A well-behaved session that must keep working while the fuzzing goes on."""
    session = rgpu.connect(server.url)
    return session, torch.arange(10.0, device="rgpu")


@settings(max_examples=NETWORK_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(batch=st.lists(frames(), min_size=1, max_size=4))
def test_hostile_frames_over_the_network_leave_other_sessions_working(server, honest, batch):
    session, x = honest
    auth = {"Authorization": f"Bearer {os.environ['RGPU_TOKEN']}"}
    hello = p.hello_frame(
        {"protocol": p.PROTOCOL_VERSION, "torch": torch.__version__, "client": "fuzz"}
    )
    with ws_connect(server.url, compression=None, additional_headers=auth, max_size=None) as raw:
        raw.send(hello)
        assert p.frame_kind(raw.recv(timeout=10)) == p.Frame.WELCOME
        # the garbage, then a sequence gap, which the server must refuse: every connection ends
        # with a protocol error (a TimeoutError here means the server hung on the input)
        with pytest.raises(ConnectionClosed):
            for frame in batch:
                raw.send(frame)
            raw.send(p.batch_frame(1 << 40, [ENC.encode([p.Kind.SYNC])]))
            while True:
                frame = raw.recv(timeout=10)
                if frame[0] == p.Frame.REPLY:
                    _, status, value = p.parse_reply(frame)
                    assert "internal server error" not in str(value)
    assert raw.close_code in (p.CloseCode.PROTOCOL_ERROR, 1009), raw.close_code  # 1009: too big
    CASES["network"] += 1
    assert session is rgpu.current_session()
    assert (x * 2).sum().item() == 90.0  # the honest session carries on


def test_every_generated_case_ran():
    """Each fuzz test that ran went through all its examples (none was skipped or filtered)."""
    print(
        f"\nfuzz cases: {CASES['in_process']} in-process frame sequences, {CASES['network']} network connections"
    )
    if CASES["in_process"] == 0 and CASES["network"] == 0:
        pytest.skip("run the fuzz tests to count their cases")
    assert CASES["in_process"] in (0, IN_PROCESS_EXAMPLES)
    assert CASES["network"] in (0, NETWORK_EXAMPLES)
