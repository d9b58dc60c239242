"""The bulk lane: large transfers as raw bytes on a second connection, checked against the CPU.

A real server; the lane's failures come from rgpu.netem cutting that connection mid-transfer,
after which the transfer must finish over the websocket with the same bytes.
"""

from __future__ import annotations

import socket
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from rgpu_test_servers import port_of

import rgpu
from rgpu.lane import Lane, LaneError
from rgpu_protocol import ProtocolError
from rgpu_protocol.lane import (
    FROM_CLIENT,
    FROM_SERVER,
    HEADER_SIZE,
    LaneRecord,
    lane_header,
    parse_lane_header,
)

BIG = 3_000_000  # float32 elements: 12 MB, over the 4 MiB lane threshold


def _counts(session) -> tuple[int, int, int]:
    s = session.stats()
    return s["lane_transfers"], s["waits"], s["reconnects"]


def test_large_transfers_ride_the_lane(server):
    session = rgpu.connect(server.url)
    host = torch.randn(BIG)
    lanes0, waits0, _ = _counts(session)
    dev = host.to("rgpu")
    assert _counts(session)[:2] == (lanes0 + 1, waits0)  # staged and confirmed: no wait
    assert torch.equal(dev.cpu(), host)
    assert _counts(session)[:2] == (lanes0 + 2, waits0 + 1)  # one wait for the download
    # ops on the uploaded tensor see its bytes
    assert (dev * 2 + 1).sum().item() == pytest.approx((host * 2 + 1).sum().item(), rel=1e-5)
    info = session.info()
    assert info["lane_transfers"] == lanes0 + 2  # the server took both through the lane
    assert info["lane_staged_bytes"] == 0  # nothing left staged


def test_lane_casts_strides_and_layouts(server):
    session = rgpu.connect(server.url)
    lanes0 = session.stats()["lane_transfers"]
    a = torch.randn(1500, 2000)
    # a cast on the way in, a transposed CPU source, a strided rgpu destination
    assert torch.equal(a.to("rgpu", torch.float64).cpu(), a.double())
    assert torch.equal(a.t().to("rgpu").cpu(), a.t())
    dst = torch.zeros(2000, 1500, device="rgpu").t()
    dst.copy_(a)
    assert torch.equal(dst.cpu(), a)
    # a transposed rgpu tensor and a channels_last one come back with their strides
    back = dst.cpu()
    assert back.stride() == (1, 1500)
    img = torch.randn(8, 64, 64, 64).contiguous(memory_format=torch.channels_last)
    r = img.to("rgpu")
    out = r.cpu()
    assert torch.equal(out, img) and out.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(r.to("cpu", torch.float16), img.half())
    # int64, bool and complex bytes survive unchanged
    for t in (
        torch.randint(-(2**62), 2**62, (1_000_000,)),
        torch.rand(5_000_000) > 0.5,
        torch.randn(700_000, dtype=torch.complex64),
    ):
        assert torch.equal(t.to("rgpu").cpu(), t)
    assert session.stats()["lane_transfers"] - lanes0 >= 14


def test_the_lane_can_be_turned_off(server, monkeypatch):
    monkeypatch.setenv("RGPU_LANE", "0")
    session = rgpu.connect(server.url)
    host = torch.randn(BIG)
    assert torch.equal(host.to("rgpu").cpu(), host)
    assert session.stats()["lane_transfers"] == 0


def test_the_threshold_is_a_setting(server, monkeypatch):
    monkeypatch.setenv("RGPU_LANE_MIN_BYTES", str(64 << 20))
    session = rgpu.connect(server.url)
    host = torch.randn(BIG)
    assert torch.equal(host.to("rgpu").cpu(), host)
    assert session.stats()["lane_transfers"] == 0


@pytest.fixture
def lane_proxy(proxied):
    """A proxy whose n-th connection is cut after budgets[n] bytes (None: never)."""

    def make(budgets: list):
        plan = iter(budgets)
        return proxied(cut_budget=lambda: next(plan, None))

    return make


def test_a_lane_cut_mid_upload_and_mid_download_loses_nothing(lane_proxy):
    # connection 1 is the websocket (never cut); 2, the first lane, is cut 5 MB into an upload;
    # 3, the next lane, 5 MB into a download; 4 is left alone
    proxy = lane_proxy([None, 5_000_000, 5_000_000, None])
    session = rgpu.connect(proxy.url)
    host = torch.randn(BIG)
    dev = host.to("rgpu")  # the lane dies mid-way: the bytes go over the websocket instead
    assert proxy.cuts == 1
    assert session.stats()["lane_transfers"] == 0
    assert torch.equal(dev.cpu(), host)  # a new lane, cut mid-download: asked again
    assert proxy.cuts == 2
    assert session.stats()["lane_transfers"] == 0
    assert torch.equal((dev + 1).cpu(), host + 1)  # a third lane carries it
    assert session.stats()["lane_transfers"] == 1
    assert session.stats()["reconnects"] == 0  # the websocket never noticed
    assert proxy.connections == 4


def test_a_lane_needs_the_session_key(server):
    session = rgpu.connect(server.url)
    host, port = "127.0.0.1", port_of(server.url)
    with pytest.raises(LaneError, match="403"):
        Lane(server.url, path="/lane", token=session.token, session=session.session_bytes,
             key=b"\0" * 16)  # fmt: skip
    with pytest.raises(LaneError, match="403"):
        Lane(server.url, path="/lane", token=session.token, session=b"\1" * 16,
             key=session.welcome.lane.key)  # fmt: skip
    # with the right key the lane opens; then the session still works
    lane = Lane(server.url, path="/lane", token=session.token, session=session.session_bytes,
                key=session.welcome.lane.key)  # fmt: skip
    lane.close()
    # raw requests: without the token, 401; with it but without the lane headers, 403
    for auth, status in (
        (b"", b"401"),
        (f"Authorization: Bearer {session.token}\r\n".encode(), b"403"),
    ):
        with socket.create_connection((host, port)) as s:
            s.sendall(
                b"GET /lane HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
                + auth
                + b"\r\n"
            )
            assert s.recv(100).split(b"\r\n")[0].split(b" ")[1] == status
    x = torch.randn(BIG)
    assert torch.equal(x.to("rgpu").cpu(), x)


def _closed_by_server(lane: Lane) -> None:
    deadline = time.monotonic() + 10
    while not lane.closed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert lane.closed and isinstance(lane.error, LaneError)
    assert str(lane.error) == "the lane closed"  # the server's end, not ours


def test_a_bad_lane_record_closes_only_that_lane(server):
    session = rgpu.connect(server.url)
    lane = Lane(server.url, path="/lane", token=session.token, session=session.session_bytes,
                key=session.welcome.lane.key)  # fmt: skip
    lane.sock.sendall(bytes([0x44]) + bytes(16))  # a DATA record: only the server sends those
    _closed_by_server(lane)
    # a PUT bigger than the session may stage is refused the same way
    lane = Lane(server.url, path="/lane", token=session.token, session=session.session_bytes,
                key=session.welcome.lane.key)  # fmt: skip
    lane.sock.sendall(lane_header(LaneRecord.PUT, 1, 1 << 60))
    _closed_by_server(lane)
    x = torch.randn(BIG)
    assert torch.equal(x.to("rgpu").cpu(), x)
    assert session.stats()["lane_transfers"] == 2


def test_lane_headers():
    h = lane_header(LaneRecord.PUT, 7, 1 << 20)
    assert len(h) == HEADER_SIZE
    assert parse_lane_header(h, FROM_CLIENT, 1 << 30) == (LaneRecord.PUT, 7, 1 << 20)
    with pytest.raises(ProtocolError, match="exceeds"):
        parse_lane_header(h, FROM_CLIENT, 1 << 19)
    with pytest.raises(ProtocolError, match="unexpected"):
        parse_lane_header(h, FROM_SERVER, 1 << 30)  # the server never sends PUT
    with pytest.raises(ProtocolError, match="unexpected"):
        parse_lane_header(bytes([0xFF]) + bytes(16), FROM_CLIENT, 1 << 30)
    with pytest.raises(ProtocolError, match="17 bytes"):
        parse_lane_header(h[:-1], FROM_CLIENT, 1 << 30)


def test_a_lane_upload_replayed_after_a_websocket_cut_is_applied_once(lane_proxy):
    proxy = lane_proxy([])
    session = rgpu.connect(proxy.url)
    host = torch.randn(BIG)
    dev = host.to("rgpu")
    dev.add_(1)  # applied once: twice would show
    session.flush()
    time.sleep(0.3)  # the server has applied both; the client has no ACK for them yet
    proxy.cut_all()  # the websocket and the lane: the resume must not apply them again
    assert torch.equal(dev.cpu(), host + 1)
    assert session.stats()["reconnects"] == 1
    assert session.stats()["lane_transfers"] == 2


def test_lane_uploads_are_hashed_for_dedup_only_on_a_slow_lane(server):
    session = rgpu.connect(server.url)
    host = torch.randn(BIG)
    a, b = host.to("rgpu"), host.to("rgpu")
    # a fast lane: hashing would cost more than sending, so neither was hashed or remembered
    assert session.stats()["dedup_hits"] == 0
    assert session.uploads._layouts.get((host.dtype, tuple(host.shape)), 0) == 0
    session.link.lane_bps = 100e6  # as if the last lane upload had run at 100 MB/s
    c = host.to("rgpu")  # hashed while it goes out, and remembered
    d = host.to("rgpu")  # the same bytes again: a copy on the server, nothing sent
    assert session.stats()["dedup_hits"] == 1
    assert session.stats()["lane_transfers"] == 3
    for t in (a, b, c, d):
        assert torch.equal(t.cpu(), host)


@given(st.binary(min_size=0, max_size=40), st.sampled_from([FROM_CLIENT, FROM_SERVER]))
def test_hostile_lane_headers_raise_protocol_errors_only(data, allowed):
    try:
        kind, ticket, nbytes = parse_lane_header(data, allowed, 1 << 30)
    except ProtocolError:
        return
    assert len(data) == HEADER_SIZE and kind in allowed and nbytes >= 0 and ticket >= 0
    assert lane_header(kind, ticket, nbytes) == data


def test_threads_share_the_lane(server):
    import threading

    session = rgpu.connect(server.url)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            g = torch.Generator().manual_seed(seed)
            for _ in range(3):
                host = torch.randn(1_200_000 + seed, generator=g)  # ~4.8 MB, all a little different
                dev = host.to("rgpu")
                assert torch.equal((dev * 2).cpu(), host * 2)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert session.stats()["lane_transfers"] == 4 * 3 * 2
