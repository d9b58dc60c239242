"""Op-stream compression: BATCH_Z frames when the link is slow (measured) or when asked; never for
batches that carry tensor bytes; a hostile compressed frame costs only its own connection."""

from __future__ import annotations

import os
import zlib

import msgpack
import pytest
import torch
from fault_proxy import FaultProxy
from rgpu_test_servers import port_of
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as ws_connect

import rgpu
import rgpu_protocol as p
from rgpu.errors import RgpuError
from rgpu.link import SLOW_LINK_RTT_S

AUTH = {"Authorization": f"Bearer {os.environ['RGPU_TOKEN']}"}


def _op_loop(x: torch.Tensor, steps: int = 400) -> torch.Tensor:
    for i in range(steps):
        x = (x * 0.999 + i / steps).relu()
    return x


# -- the frame format, without I/O -----------------------------------------------------------------


def test_batch_round_trips_through_compression():
    msgs = [
        msgpack.packb([p.Kind.RUN, "add.Tensor", [i, i + 1], None, [i + 2]]) for i in range(200)
    ]
    frame = p.batch_frame(7, msgs)
    packed = p.compress_batch(frame)
    assert packed is not None and packed[0] == p.Frame.BATCH_Z
    assert len(packed) * 3 < len(frame)  # the op stream compresses well
    assert p.decompress_batch(packed) == frame
    assert [m for m in p.BatchReader(p.decompress_batch(packed))] == [
        m for m in p.BatchReader(frame)
    ]


def test_incompressible_batch_is_left_alone():
    frame = p.batch_frame(1, [os.urandom(4000)])
    assert p.compress_batch(frame) is None


def test_decompression_is_bounded_and_checked():
    limits = p.Limits(max_message=1 << 20)
    bomb = bytes((p.Frame.BATCH_Z,)) + zlib.compress(bytes(64 << 20), 9)  # 64 MiB of zeros
    assert len(bomb) < 100_000
    with pytest.raises(p.LimitExceeded, match="inflates past the limit of 1048576"):
        p.decompress_batch(bomb, limits)
    good = p.compress_batch(p.batch_frame(1, [b"\x91\x07"] * 500))
    with pytest.raises(p.ProtocolError, match="corrupt compressed batch"):
        p.decompress_batch(good[:3] + b"\x00garbage" + good[11:])
    with pytest.raises(p.ProtocolError, match="truncated"):
        p.decompress_batch(good[:-4])
    with pytest.raises(p.ProtocolError, match="not a BATCH_Z frame"):
        p.decompress_batch(b"\x01abc")


# -- end to end against a real server ----------------------------------------------------------------


def test_asked_for_compression_gives_the_same_values_in_fewer_bytes(server, monkeypatch):
    monkeypatch.setenv("RGPU_COMPRESS", "1")
    session = rgpu.connect(server.url)
    assert session.compressing
    host = torch.randn(64, 64)
    got = _op_loop(host.to("rgpu")).cpu()
    torch.testing.assert_close(got, _op_loop(host))
    stats = rgpu.stats()
    assert stats["compressed_frames"] >= 3
    raw_bytes = session.bytes_out  # the messages as encoded, before compression
    assert stats["bytes_out"] == raw_bytes - stats["compression_saved"]
    assert stats["compression_saved"] > 0.6 * (raw_bytes - 64 * 64 * 4)  # ops shrink > 2.5x


def test_batches_that_are_mostly_tensor_bytes_are_not_compressed(server, monkeypatch):
    monkeypatch.setenv("RGPU_COMPRESS", "1")
    rgpu.connect(server.url)
    before = rgpu.stats()["compressed_frames"]
    data = torch.randn(50_000)  # 200 kB: an inline upload, inside the op stream
    r = data.to("rgpu")
    torch.rgpu.synchronize()
    assert rgpu.stats()["compressed_frames"] == before
    assert torch.equal(r.cpu(), data)
    # a small upload among many ops (a training batch) does not stop the ops being compressed
    small = torch.randint(0, 65, (8, 64))  # 4 kB
    acc = torch.zeros(8, 64, device="rgpu")
    tokens = small.to("rgpu")
    for _ in range(200):
        acc = acc + tokens
    assert torch.equal(acc.cpu(), small.float() * 200)
    assert rgpu.stats()["compressed_frames"] > before


def test_compression_off_by_default_on_a_fast_link(server, monkeypatch):
    monkeypatch.delenv("RGPU_COMPRESS", raising=False)
    session = rgpu.connect(server.url)
    assert session.link.rtt_s < SLOW_LINK_RTT_S and not session.compressing
    host = torch.randn(32, 32)
    torch.testing.assert_close(_op_loop(host.to("rgpu")).cpu(), _op_loop(host))
    big = torch.randn(1 << 19)  # 2 MiB: measures the link's throughput on the way back
    assert torch.equal(big.to("rgpu").cpu(), big)
    assert session.link.bps is not None and session.link.bps > 50e6
    assert not session.compressing and rgpu.stats()["compressed_frames"] == 0


@pytest.fixture
def link(server):
    """Connect through an emulated link (rgpu.netem) to the test server."""
    made = []

    def connect(**kwargs):
        emulator = FaultProxy(port_of(server.url), **kwargs)
        made.append(emulator)
        return rgpu.connect(emulator.url)

    yield connect
    rgpu.disconnect()
    for emulator in made:
        emulator.close()


def _ops_match_cpu_compressed() -> None:
    host = torch.randn(32, 32)
    torch.testing.assert_close(_op_loop(host.to("rgpu")).cpu(), _op_loop(host))
    assert rgpu.stats()["compressed_frames"] >= 1


def test_a_long_round_trip_turns_compression_on(link, monkeypatch):
    monkeypatch.delenv("RGPU_COMPRESS", raising=False)
    session = link(latency_s=0.01)  # 20 ms RTT
    assert session.link.rtt_s >= 0.02 and session.compressing
    _ops_match_cpu_compressed()


def test_a_slow_download_turns_compression_on(link, monkeypatch):
    monkeypatch.delenv("RGPU_COMPRESS", raising=False)
    session = link(bandwidth_bps=5e6)  # 40 Mbit/s, no added latency
    # no latency is added: only a machine too busy to answer a ping in 10 ms would say slow
    assert session.compressing == (session.link.rtt_s >= SLOW_LINK_RTT_S)
    big = torch.randn(400_000)  # 1.6 MB
    assert torch.equal(big.to("rgpu").cpu(), big)
    assert session.link.bps is not None and session.link.bps < 10e6
    assert session.compressing
    _ops_match_cpu_compressed()


def test_compression_can_be_turned_off(link, monkeypatch):
    monkeypatch.setenv("RGPU_COMPRESS", "0")
    session = link(latency_s=0.01)
    assert not session.compressing
    assert _op_loop(torch.ones(8, device="rgpu"), 300).sum().item() == pytest.approx(
        _op_loop(torch.ones(8), 300).sum().item()
    )
    assert rgpu.stats()["compressed_frames"] == 0


def test_a_bad_setting_is_a_clear_error(server, monkeypatch):
    monkeypatch.setenv("RGPU_COMPRESS", "sometimes")
    with pytest.raises(RgpuError, match=r"RGPU_COMPRESS='sometimes'.*auto.*1.*0"):
        rgpu.connect(server.url)


def test_a_compression_bomb_closes_only_its_connection(dev, server):
    assert torch.ones(2, device=dev).sum().item() == 2.0
    with ws_connect(server.url, compression=None, additional_headers=AUTH) as raw:
        hello = {"protocol": p.PROTOCOL_VERSION, "torch": torch.__version__, "client": "bomb"}
        raw.send(p.hello_frame(hello))
        welcome = p.parse_handshake(raw.recv(timeout=10), p.Frame.WELCOME)
        assert welcome["compress"] == ["zlib"]
        raw.send(bytes((p.Frame.BATCH_Z,)) + zlib.compress(bytes(256 << 20), 9))  # 256 MiB inflated
        seq, status, value = p.parse_reply(raw.recv(timeout=30))
        assert (seq, status) == (0, p.Status.PROTOCOL)
        assert "inflates past the limit" in value
        with pytest.raises(ConnectionClosed):
            raw.recv(timeout=10)
    assert (torch.ones(3, device=dev) * 2).sum().item() == 6.0  # everyone else carries on
