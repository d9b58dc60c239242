"""The wire facts of several devices, without a server: WELCOME's device list, the new message
kinds' shapes, and the peer transfer's header (rgpu_protocol)."""

from __future__ import annotations

import msgpack
import pytest
import torch

from rgpu_protocol import COLLECTIVE_OPS, SPECS, Kind, ProtocolError, Welcome, check_message
from rgpu_protocol.peer import PeerRefused, parse_peer_header, peer_error, peer_header


def _welcome(**kw) -> Welcome:
    return Welcome(
        server="0", torch="2.13", session=b"s" * 16, device="cpu", device_name="CPU", **kw
    )


def test_welcome_lists_every_device_and_the_server_id():
    w = _welcome(devices=(("cuda:0", "H200"), ("cuda:2", "H200")), server_id=b"12345678")
    back = Welcome.parse(w.frame())
    assert back.devices == (("cuda:0", "H200"), ("cuda:2", "H200"))
    assert back.device_list == back.devices and back.server_id == b"12345678"


def test_an_older_servers_welcome_means_one_device():
    back = Welcome.parse(_welcome().frame())
    assert back.devices == () and back.device_list == (("cpu", "CPU"),)


def test_a_malformed_device_list_is_a_protocol_error():
    w = _welcome()
    frame = bytearray(w.frame())
    d = msgpack.unpackb(bytes(frame[1:]))
    d["devices"] = [["cpu"]]
    with pytest.raises(ProtocolError, match="devices"):
        Welcome.parse(bytes(frame[:1]) + msgpack.packb(d, use_bin_type=True))


@pytest.mark.parametrize(
    "msg",
    [
        [Kind.DEVICE, 3],
        [Kind.SEED, 7],
        [Kind.SEED, 7, 1],
        [Kind.SEED, 7, None],
        [Kind.GROUP, "k", 0, 2, 30.0],
        [Kind.COLLECTIVE, "k", "all_reduce", [], {"op": "sum"}],
        [Kind.EXPORT, None, b"c" * 16],
        [Kind.IMPORT, None, "ws://h:1", b"c" * 16],
    ],
)
def test_the_new_messages_have_specs(msg):
    assert check_message(msg).kind == msg[0]


@pytest.mark.parametrize(
    "msg",
    [[Kind.DEVICE, "1"], [Kind.GROUP, "k", 0, 2], [Kind.COLLECTIVE, "k", "x", {}, None],
     [Kind.IMPORT, None, 1, b""]],
)  # fmt: skip
def test_malformed_new_messages_are_protocol_errors(msg):
    with pytest.raises(ProtocolError):
        check_message(msg)


def test_waited_kinds_and_collective_ops():
    assert SPECS[Kind.GROUP].waited and not SPECS[Kind.COLLECTIVE].waited
    assert not SPECS[Kind.DEVICE].waited and not SPECS[Kind.EXPORT].waited
    assert set(COLLECTIVE_OPS) >= {"all_reduce", "broadcast", "all_gather", "reduce_scatter",
                                   "barrier"}  # fmt: skip


def test_peer_headers_roundtrip_and_refuse():
    assert parse_peer_header(peer_header(torch.float16, (2, 3), 12), 12) == (
        torch.float16, (2, 3), 12)  # fmt: skip
    with pytest.raises(ProtocolError):
        parse_peer_header(peer_header(torch.float32, (4,), 16), 8)  # more than it may take
    with pytest.raises(PeerRefused, match="expired"):
        parse_peer_header(peer_error("it expired"), 8)
    with pytest.raises(ProtocolError):
        parse_peer_header(b"\xc1", 8)
