"""The wire format alone: bytes in, values out, no sockets. Hostile bytes included."""

from __future__ import annotations

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rgpu_protocol as p
from rgpu_protocol.codec import Limits

ENC = p.Encoder()


def roundtrip(value):
    return p.unpack_one(ENC.encode(value))


@pytest.mark.parametrize("dtype", sorted(p.DTYPE_TO_CODE, key=str))
def test_every_dtype_roundtrips_as_an_ext_type(dtype):
    assert roundtrip(dtype) is dtype
    assert isinstance(msgpack.unpackb(ENC.encode(dtype)), msgpack.ExtType)


@pytest.mark.parametrize(
    "value",
    [torch.strided, torch.sparse_coo, torch.channels_last, torch.contiguous_format, torch.preserve_format,
     torch.channels_last_3d, 3 + 4j, complex(float("inf"), -0.0)],
)  # fmt: skip
def test_layouts_memory_formats_and_complex_roundtrip(value):
    assert roundtrip(value) == value


def test_device_and_ref_decode_to_value_objects():
    assert roundtrip(torch.device("rgpu", 0) if False else p.Device("rgpu:0")) == p.Device("rgpu:0")
    assert roundtrip(p.Ref(2**63 + 5)) == p.Ref(2**63 + 5)


def test_host_tensor_carries_raw_bytes_not_a_list_of_numbers():
    t = torch.arange(1000, dtype=torch.float32)
    raw = ENC.encode(p.HostData(t.dtype, tuple(t.shape), t.numpy().tobytes()))
    # 4000 data bytes + a small header: numbers are not msgpack-encoded one by one
    assert 4000 < len(raw) < 4000 + 32
    back = p.unpack_one(raw)
    assert back.dtype == torch.float32 and back.shape == (1000,)
    assert torch.equal(torch.frombuffer(bytearray(back.data), dtype=torch.float32), t)


def test_tensor_meta_roundtrip():
    m = p.TensorMeta(torch.complex64, (2, 3), (1, 2), 5, True, False)
    assert roundtrip(m) == m


def test_unsendable_values_raise_encode_error():
    with pytest.raises(p.EncodeError, match="Generator"):
        ENC.encode([torch.Generator()])
    with pytest.raises(p.EncodeError):
        ENC.encode(2**70)
    # the encoder stays usable after a failure
    assert p.unpack_one(ENC.encode([1, "x"])) == [1, "x"]


def test_batch_frame_numbers_messages_consecutively():
    msgs = [
        ENC.encode([p.Kind.RUN, "add.Tensor", [p.Ref(1), 1], None, [2]]),
        ENC.encode([p.Kind.SYNC]),
    ]
    frame = p.batch_frame(41, msgs)
    reader = p.BatchReader(frame)
    assert reader.first_seq == 41
    got = list(reader)
    assert got[0][0] == p.Kind.RUN and got[0][2] == [p.Ref(1), 1]
    assert got[1] == [p.Kind.SYNC]


def test_reply_and_chunk_frames_roundtrip():
    seq, status, value = p.parse_reply(
        p.reply_frame(ENC.encode, 7, p.Status.ERROR, ["aten::mm", "boom"])
    )
    assert (seq, status, value) == (7, p.Status.ERROR, ["aten::mm", "boom"])
    parts = p.chunk_frame(p.Frame.CHUNK, 9, 4096, b"abc")
    seq, off, payload = p.parse_chunk(b"".join(parts))
    assert (seq, off, bytes(payload)) == (9, 4096, b"abc")


def test_handshake_frames_and_refusal():
    info = {"protocol": 1, "torch": "2.13.0"}
    assert p.parse_handshake(p.hello_frame(info), p.Frame.HELLO) == info
    refused = p.parse_handshake(p.refuse_frame("protocol", "too old"), p.Frame.WELCOME)
    assert refused == {"refused": "protocol", "message": "too old"}
    with pytest.raises(p.ProtocolError, match="expected a WELCOME"):
        p.parse_handshake(p.hello_frame(info), p.Frame.WELCOME)


def test_version_check_compares_major_minor_and_names_both():
    assert p.version_mismatch("2.13.0+cpu", "2.13.1+cu128") is None
    msg = p.version_mismatch("2.13.0", "2.11.0")
    assert "2.13.0" in msg and "2.11.0" in msg and "RGPU_ALLOW_VERSION_MISMATCH" in msg


# -- limits -----------------------------------------------------------------------------------

SMALL = Limits(max_message=4096, max_depth=4, max_list=16, max_map=8, max_str=32, max_chunk=64)


@pytest.mark.parametrize(
    "value, what",
    [
        ([[[[[[1]]]]]], "deep"),
        (list(range(17)), "long list"),
        ("x" * 33, "long string"),
        ({str(i): i for i in range(9)}, "big map"),
    ],
)
def test_decoder_enforces_limits(value, what):
    with pytest.raises(p.ProtocolError):
        p.unpack_one(msgpack.packb(value), SMALL)


def test_oversized_frames_and_chunks_are_refused():
    with pytest.raises(p.LimitExceeded):
        p.BatchReader(p.batch_frame(1, [b"\x90"] * 5000), SMALL)
    with pytest.raises(p.LimitExceeded):
        p.parse_chunk(b"".join(p.chunk_frame(p.Frame.CHUNK, 1, 0, b"x" * 65)), SMALL)


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\x01",
        b"\x01\xc1",
        b"\x01\x00",
        b"\x01\xa3abc",
        b"\x01\x01\x92",
        b"\x01\x01\xa1x",
        b"\x01\x01\xc0",
    ],
)
def test_malformed_batches_raise_protocol_errors(frame):
    with pytest.raises(p.ProtocolError):
        list(p.BatchReader(frame))


@pytest.mark.parametrize(
    "ext",
    [
        msgpack.ExtType(p.codec.EXT_DTYPE, b"\xff"),
        msgpack.ExtType(p.codec.EXT_DTYPE, b""),
        msgpack.ExtType(p.codec.EXT_REF, b"123"),
        msgpack.ExtType(p.codec.EXT_HOST, b"\x01"),
        msgpack.ExtType(
            p.codec.EXT_HOST, b"\x01\x01" + (3).to_bytes(8, "little", signed=True) + b"\x00" * 11
        ),
        msgpack.ExtType(p.codec.EXT_HOST, b"\x01\x01" + (-1).to_bytes(8, "little", signed=True)),
        msgpack.ExtType(p.codec.EXT_META, b"\x01\x05\x00"),
        msgpack.ExtType(p.codec.EXT_COMPLEX, b"\x00" * 15),
        msgpack.ExtType(p.codec.EXT_DEVICE, b"\xff\xfe"),
        msgpack.ExtType(99, b""),
    ],
)
def test_hostile_ext_payloads_raise_protocol_errors(ext):
    with pytest.raises(p.ProtocolError):
        p.unpack_one(msgpack.packb([ext]))


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=256))
def test_random_bytes_never_crash_the_batch_reader(data):
    try:
        list(p.BatchReader(b"\x01" + data, SMALL))
    except p.ProtocolError:
        pass


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=256))
def test_random_bytes_never_crash_the_reply_parser(data):
    try:
        p.parse_reply(b"\x11" + data, SMALL)
    except p.ProtocolError:
        pass


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False) | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=5), children, max_size=5),
    max_leaves=30,
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(msgpack_values)
def test_plain_values_roundtrip_or_are_refused_by_limits(value):
    try:
        assert p.unpack_one(ENC.encode(value)) == value
    except p.LimitExceeded:
        pass
