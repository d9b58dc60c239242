"""rgpu's wire format, with no I/O: bytes in, values out.

Both the client (`rgpu`) and the server (`rgpu_server`) import this package; importing it never
registers the rgpu device. See docs/protocol.md.
"""

from .buffers import byte_view
from .codec import (
    DEFAULT_LIMITS,
    DTYPE_TO_CODE,
    CODE_TO_DTYPE,
    EXT_HOST,
    EXT_REF,
    EXT_VIEW,
    Device,
    Encoder,
    HostData,
    Limits,
    Ref,
    TensorMeta,
    ViewRef,
    check_depth,
    decode_host,
    decode_simple_ext,
    decode_view,
    default,
    default_ext_hook,
    host_ext,
    make_unpacker,
    meta_ext,
    ref_ext,
    unpack_one,
    unpack_ref,
    view_ext,
)
from .errors import EncodeError, LimitExceeded, ProtocolError
from .messages import (
    PROTOCOL_VERSION,
    WAITED,
    BatchReader,
    ack_frame,
    parse_ack,
    CloseCode,
    Frame,
    Kind,
    Status,
    batch_frame,
    chunk_frame,
    frame_kind,
    hello_frame,
    parse_chunk,
    parse_handshake,
    parse_reply,
    refuse_frame,
    reply_frame,
    torch_major_minor,
    version_mismatch,
    welcome_frame,
)

__all__ = [name for name in dir() if not name.startswith("_")]
