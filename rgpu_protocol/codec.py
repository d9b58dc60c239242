"""msgpack values with rgpu's extension types, and decoding under limits.

Tensor references, dtypes, devices, layouts, memory formats, complex scalars, small host tensors
and tensor metadata travel as msgpack ext types; everything else is plain msgpack. Codes for
dtypes, layouts and memory formats are fixed numbers, not names, so a client and a server on
different torch releases agree on them.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from .errors import EncodeError, LimitExceeded, ProtocolError
from .generators import EXT_GENERATOR, decode_generator
from .slots import EXT_SLOT, EXT_SLOT_VIEW, Slot, SlotView, decode_slot, encode_slot

# ext type codes (application range 0..127)
EXT_REF = 1  # tensor id: u64
EXT_DTYPE = 2  # u8 dtype code
EXT_DEVICE = 3  # utf-8 device string
EXT_LAYOUT = 4  # u8 layout code
EXT_MEMFMT = 5  # u8 memory-format code
EXT_HOST = 6  # small CPU tensor: u8 dtype, u8 ndim, i64 shape[ndim], raw bytes
EXT_COMPLEX = 7  # two f64
EXT_META = 8  # tensor metadata: u8 dtype, u8 ndim, u8 flags, i64 shape, i64 stride, i64 offset
EXT_VIEW = 9  # a view of a tensor: u64 base id, u8 ndim, i64 shape, i64 stride, i64 offset
EXT_NODE = 10  # a reference to an earlier node of a shipped graph: u32 index
# EXT_SLOT = 11, EXT_SLOT_VIEW = 12: values of a defined sequence (slots.py)
# EXT_GENERATOR = 13: a generator the client made on an rgpu device (generators.py)

# Fixed wire codes. Never renumber; append only.
_DTYPE_NAMES = (
    "float32", "float64", "float16", "bfloat16", "complex64", "complex128", "complex32",
    "uint8", "int8", "int16", "int32", "int64", "bool", "uint16", "uint32", "uint64",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
)  # fmt: skip
DTYPE_TO_CODE: dict[torch.dtype, int] = {}
CODE_TO_DTYPE: dict[int, torch.dtype] = {}
for _code, _name in enumerate(_DTYPE_NAMES, start=1):
    _dt = getattr(torch, _name, None)
    if isinstance(_dt, torch.dtype):
        DTYPE_TO_CODE[_dt] = _code
        CODE_TO_DTYPE[_code] = _dt

_LAYOUT_NAMES = ("strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc")
LAYOUT_TO_CODE = {getattr(torch, n): i for i, n in enumerate(_LAYOUT_NAMES, start=1)}
CODE_TO_LAYOUT = {i: lay for lay, i in LAYOUT_TO_CODE.items()}
_MEMFMT_NAMES = ("contiguous_format", "channels_last", "channels_last_3d", "preserve_format")
MEMFMT_TO_CODE = {getattr(torch, n): i for i, n in enumerate(_MEMFMT_NAMES, start=1)}
CODE_TO_MEMFMT = {i: f for f, i in MEMFMT_TO_CODE.items()}

# precomputed ext objects: encoding a dtype is a dict lookup, not a struct.pack
DTYPE_EXT = {dt: msgpack.ExtType(EXT_DTYPE, bytes((c,))) for dt, c in DTYPE_TO_CODE.items()}
LAYOUT_EXT = {lay: msgpack.ExtType(EXT_LAYOUT, bytes((c,))) for lay, c in LAYOUT_TO_CODE.items()}
MEMFMT_EXT = {f: msgpack.ExtType(EXT_MEMFMT, bytes((c,))) for f, c in MEMFMT_TO_CODE.items()}

_U64 = struct.Struct("<Q")
_HOST_HEAD = struct.Struct("<BB")
_META_HEAD = struct.Struct("<BBB")
_COMPLEX = struct.Struct("<dd")
MAX_NDIM = 64


@dataclass(frozen=True, slots=True)
class Ref:
    """A tensor id as it appears after decoding with the default hook."""

    id: int


@dataclass(frozen=True, slots=True)
class Device:
    """A device as named by the client ("rgpu", "rgpu:0", "cpu", "meta")."""

    name: str


@dataclass(frozen=True, slots=True)
class HostData:
    """Bytes of a small CPU tensor carried inline: contiguous, in `dtype`, of `shape`."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    data: bytes


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """Shape, strides, offset and dtype of a tensor the server produced."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    conj: bool = False
    neg: bool = False


def _ext(code: int, data: bytes) -> msgpack.ExtType:
    # ExtType's own __new__ re-checks its arguments in Python; these are known good
    return tuple.__new__(msgpack.ExtType, (code, data))


def ref_ext(tensor_id: int) -> msgpack.ExtType:
    return _ext(EXT_REF, _U64.pack(tensor_id))


def view_ext(
    base_id: int, shape: tuple[int, ...], stride: tuple[int, ...], offset: int
) -> msgpack.ExtType:
    """A tensor that is `base.as_strided(shape, stride, offset)`: a view the server never stored."""
    n = len(shape)
    return _ext(EXT_VIEW, struct.pack(f"<QB{2 * n + 1}q", base_id, n, *shape, *stride, offset))


@dataclass(frozen=True, slots=True)
class NodeRef:
    """The output of node `index` of a graph (see Kind.COMPILE)."""

    index: int


_U32 = struct.Struct("<I")


@dataclass(frozen=True, slots=True)
class ViewRef:
    """A view reference as it appears after decoding with the default hook."""

    base: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


def decode_view(data: bytes) -> ViewRef:
    if len(data) < 9:
        raise ProtocolError("view reference is truncated")
    base, n = struct.unpack_from("<QB", data)
    if n > MAX_NDIM or len(data) != 9 + 8 * (2 * n + 1):
        raise ProtocolError("view reference has the wrong length")
    vals = struct.unpack_from(f"<{2 * n + 1}q", data, 9)
    shape = vals[:n]
    if any(s < 0 for s in shape) or vals[2 * n] < 0:
        raise ProtocolError("view reference has a negative size or offset")
    return ViewRef(base, shape, vals[n : 2 * n], vals[2 * n])


def itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def host_ext(
    dtype: torch.dtype, shape: tuple[int, ...], data: bytes | memoryview
) -> msgpack.ExtType:
    code = DTYPE_TO_CODE.get(dtype)
    if code is None:
        raise EncodeError(f"rgpu cannot send tensors of dtype {dtype}")
    if len(shape) > MAX_NDIM:
        raise EncodeError(f"rgpu cannot send tensors with more than {MAX_NDIM} dimensions")
    head = _HOST_HEAD.pack(code, len(shape)) + struct.pack(f"<{len(shape)}q", *shape)
    return msgpack.ExtType(EXT_HOST, head + bytes(data))


def meta_ext(m: TensorMeta) -> msgpack.ExtType:
    n = len(m.shape)
    flags = (1 if m.conj else 0) | (2 if m.neg else 0)
    head = _META_HEAD.pack(DTYPE_TO_CODE[m.dtype], n, flags)
    body = struct.pack(f"<{2 * n + 1}q", *m.shape, *m.stride, m.offset)
    return msgpack.ExtType(EXT_META, head + body)


def default(obj: Any) -> Any:
    """msgpack `default` hook for the values both ends send."""
    t = type(obj)
    if t is torch.dtype:
        ext = DTYPE_EXT.get(obj)
        if ext is None:
            raise EncodeError(f"rgpu cannot send dtype {obj}")
        return ext
    if t is torch.device:
        return msgpack.ExtType(EXT_DEVICE, str(obj).encode())
    if t is Device:
        return msgpack.ExtType(EXT_DEVICE, obj.name.encode())
    if t is Ref:
        return ref_ext(obj.id)
    if t is ViewRef:
        return view_ext(obj.base, obj.shape, obj.stride, obj.offset)
    if t is NodeRef:
        return _ext(EXT_NODE, _U32.pack(obj.index))
    if t is Slot or t is SlotView:
        return encode_slot(obj)
    if t is complex:
        return msgpack.ExtType(EXT_COMPLEX, _COMPLEX.pack(obj.real, obj.imag))
    if t is torch.layout:
        return LAYOUT_EXT[obj]
    if t is torch.memory_format:
        return MEMFMT_EXT[obj]
    if t is HostData:
        return host_ext(obj.dtype, obj.shape, obj.data)
    if t is TensorMeta:
        return meta_ext(obj)
    raise EncodeError(f"rgpu cannot send a value of type {t.__name__} to the server")


def _decode_shape(data: bytes, pos: int, n: int) -> tuple[int, ...]:
    return struct.unpack_from(f"<{n}q", data, pos)


def decode_host(data: bytes) -> tuple[torch.dtype, tuple[int, ...], memoryview]:
    """Split an EXT_HOST payload into dtype, shape and the raw bytes; validate sizes."""
    if len(data) < 2:
        raise ProtocolError("host tensor header is truncated")
    code, n = _HOST_HEAD.unpack_from(data)
    dtype = CODE_TO_DTYPE.get(code)
    if dtype is None:
        raise ProtocolError(f"unknown dtype code {code}")
    if n > MAX_NDIM or len(data) < 2 + 8 * n:
        raise ProtocolError("host tensor shape is truncated or too long")
    shape = _decode_shape(data, 2, n)
    numel = 1
    for s in shape:
        if s < 0:
            raise ProtocolError("host tensor has a negative dimension")
        numel *= s
    raw = memoryview(data)[2 + 8 * n :]
    if len(raw) != numel * dtype.itemsize:
        raise ProtocolError(
            f"host tensor carries {len(raw)} bytes but shape {list(shape)} of {dtype} needs "
            f"{numel * dtype.itemsize}"
        )
    return dtype, shape, raw


def decode_meta(data: bytes) -> TensorMeta:
    if len(data) < 3:
        raise ProtocolError("tensor metadata is truncated")
    code, n, flags = _META_HEAD.unpack_from(data)
    dtype = CODE_TO_DTYPE.get(code)
    if dtype is None:
        raise ProtocolError(f"unknown dtype code {code}")
    if n > MAX_NDIM or len(data) != 3 + 8 * (2 * n + 1):
        raise ProtocolError("tensor metadata has the wrong length")
    vals = struct.unpack_from(f"<{2 * n + 1}q", data, 3)
    return TensorMeta(
        dtype, vals[:n], vals[n : 2 * n], vals[2 * n], bool(flags & 1), bool(flags & 2)
    )


def decode_simple_ext(code: int, data: bytes) -> Any:
    """Decode the ext types that need no session context."""
    if code == EXT_DTYPE:
        if len(data) != 1 or data[0] not in CODE_TO_DTYPE:
            raise ProtocolError(f"unknown dtype code {data!r}")
        return CODE_TO_DTYPE[data[0]]
    if code == EXT_DEVICE:
        try:
            return Device(data.decode())
        except UnicodeDecodeError:
            raise ProtocolError("device name is not UTF-8") from None
    if code == EXT_LAYOUT:
        if len(data) != 1 or data[0] not in CODE_TO_LAYOUT:
            raise ProtocolError(f"unknown layout code {data!r}")
        return CODE_TO_LAYOUT[data[0]]
    if code == EXT_MEMFMT:
        if len(data) != 1 or data[0] not in CODE_TO_MEMFMT:
            raise ProtocolError(f"unknown memory format code {data!r}")
        return CODE_TO_MEMFMT[data[0]]
    if code == EXT_COMPLEX:
        if len(data) != 16:
            raise ProtocolError("complex scalar must be 16 bytes")
        re, im = _COMPLEX.unpack(data)
        return complex(re, im)
    if code == EXT_META:
        return decode_meta(data)
    if code == EXT_NODE:
        if len(data) != 4:
            raise ProtocolError("node reference must be 4 bytes")
        return NodeRef(_U32.unpack(data)[0])
    if code == EXT_SLOT or code == EXT_SLOT_VIEW:
        return decode_slot(code, data)
    if code == EXT_GENERATOR:
        return decode_generator(data)
    raise ProtocolError(f"unknown ext type {code}")


def default_ext_hook(code: int, data: bytes) -> Any:
    """Ext hook that turns every ext type into a plain value object (no session needed)."""
    if code == EXT_REF:
        if len(data) != 8:
            raise ProtocolError("tensor reference must be 8 bytes")
        return Ref(_U64.unpack(data)[0])
    if code == EXT_HOST:
        dtype, shape, raw = decode_host(data)
        return HostData(dtype, tuple(shape), bytes(raw))
    if code == EXT_VIEW:
        return decode_view(data)
    return decode_simple_ext(code, data)


def unpack_ref(data: bytes) -> int:
    if len(data) != 8:
        raise ProtocolError("tensor reference must be 8 bytes")
    return _U64.unpack(data)[0]


@dataclass(frozen=True)
class Limits:
    """What a decoder accepts. Both ends enforce these on what they receive."""

    max_message: int = 64 * 1024 * 1024  # one websocket message
    max_depth: int = 16  # nesting of lists and maps inside one message
    max_list: int = 1 << 20  # items in one array
    max_map: int = 4096  # entries in one map
    max_str: int = 1 << 16  # bytes in one string
    max_chunk: int = 8 * 1024 * 1024  # bytes of tensor data in one chunk frame


DEFAULT_LIMITS = Limits()


def make_unpacker(limits: Limits, ext_hook: Callable[[int, bytes], Any] = default_ext_hook):
    """An incremental msgpack decoder bounded by `limits` (length of every str/bin/array/map)."""
    return msgpack.Unpacker(max_buffer_size=limits.max_message, **_bounds(limits, ext_hook))


def _bounds(limits: Limits, ext_hook: Callable[[int, bytes], Any]) -> dict:
    """msgpack's decoding options for these limits (both decoders take the same)."""
    return dict(
        ext_hook=ext_hook,
        raw=False,
        strict_map_key=True,
        max_str_len=limits.max_str,
        max_bin_len=limits.max_message,
        max_array_len=limits.max_list,
        max_map_len=limits.max_map,
        max_ext_len=limits.max_message,
    )


def check_depth(obj: Any, limit: int) -> None:
    """Raise LimitExceeded if lists/maps nest deeper than `limit` levels."""
    if limit < 0:
        raise LimitExceeded("message nests lists or maps too deeply")
    t = type(obj)
    if t is list or t is tuple:
        for x in obj:
            tx = type(x)
            if tx is list or tx is tuple or tx is dict:
                check_depth(x, limit - 1)
    elif t is dict:
        for x in obj.values():
            tx = type(x)
            if tx is list or tx is tuple or tx is dict:
                check_depth(x, limit - 1)


def unpack_one(
    data: bytes | memoryview, limits: Limits = DEFAULT_LIMITS, ext_hook=default_ext_hook
) -> Any:
    """Decode exactly one msgpack value (no trailing bytes) under limits."""
    if len(data) > limits.max_message:
        raise LimitExceeded(
            f"message of {len(data)} bytes exceeds the limit of {limits.max_message}"
        )
    try:
        value = msgpack.unpackb(data, **_bounds(limits, ext_hook))
    except ProtocolError:
        raise
    except (ValueError, TypeError, msgpack.exceptions.UnpackException) as e:
        raise ProtocolError(f"malformed msgpack: {e}") from None
    check_depth(value, limits.max_depth)
    return value


class Encoder:
    """msgpack encoder with rgpu's ext types; `extra` converts types only one end knows."""

    def __init__(self, hook: Callable[[Any], Any] = default) -> None:
        """`hook` converts values msgpack does not know; end it by calling `codec.default`."""
        self._packer = msgpack.Packer(default=hook, use_bin_type=True, autoreset=True)

    def encode(self, value: Any) -> bytes:
        try:
            return self._packer.pack(value)
        except EncodeError:
            self._packer.reset()
            raise
        except (TypeError, ValueError, OverflowError) as e:
            self._packer.reset()
            raise EncodeError(f"rgpu cannot send this value: {e}") from None
