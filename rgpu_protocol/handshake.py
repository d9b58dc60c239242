"""The handshake: HELLO from the client, WELCOME or REFUSE from the server, as typed values.

Each side builds its frame from a dataclass and reads the other's into one, so a field is named,
typed and defaulted once, here, instead of with `.get()` at every place that reads it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

import msgpack

from .codec import DEFAULT_LIMITS, Limits, unpack_one
from .errors import ProtocolError
from .frames import Frame, frame_kind

PROTOCOL_VERSION = 1


def _typed(d: dict, name: str, types: tuple, default: Any) -> Any:
    value = d.get(name, default)
    if type(value) not in types and value is not default:
        raise ProtocolError(f"handshake field {name!r} has the wrong type ({type(value).__name__})")
    return value


@dataclass(frozen=True)
class Hello:
    """What a client says first: its protocol and torch, and the session to resume, if any."""

    protocol: int
    torch: str
    client: str = "?"
    session: bytes | None = None  # the id of a session to resume
    name: str | None = None  # a named session to open, or re-open after its client went away
    takeover: bool = False  # take the named session over from a client that still holds it

    def frame(self) -> bytes:
        return hello_frame(asdict(self))

    @classmethod
    def parse(cls, frame: bytes, limits: Limits = DEFAULT_LIMITS) -> Hello:
        d = parse_handshake(frame, Frame.HELLO, limits)
        return cls(
            protocol=d.get("protocol"),  # checked by the server against PROTOCOL_VERSION
            torch=str(d.get("torch", "?")),
            client=str(d.get("client", "?")),
            session=_typed(d, "session", (bytes,), None),
            name=_typed(d, "name", (str,), None),
            takeover=bool(d.get("takeover", False)),
        )


@dataclass(frozen=True)
class LaneOffer:
    """Where and with which key a session may open its bulk lane (rgpu_protocol.lane)."""

    path: str
    key: bytes


@dataclass(frozen=True)
class Welcome:
    """The server's answer to HELLO: the session, and the facts the client needs about it."""

    server: str  # rgpu-server's version
    torch: str
    session: bytes
    device: str
    device_name: str
    max_message: int = DEFAULT_LIMITS.max_message
    max_chunk: int = DEFAULT_LIMITS.max_chunk
    resumed: bool = False
    last_seq: int = 0  # the last message the server applied (what a resume replays after)
    compress: tuple[str, ...] = ()  # BATCH_Z codecs the server understands
    lane: LaneOffer | None = None
    protocol: int = PROTOCOL_VERSION
    name: str | None = None  # a named session's name
    attached: bool = False  # a named session re-opened: only its kept objects are left
    kept: tuple[str, ...] = ()  # the names `rgpu.keep` gave objects in this session
    peek: bool = False  # the server answers PEEK frames (live device facts, out of band)
    # every device of the server, (torch device, name), in index order; empty from an older
    # server, which has one: (device, device_name). A server that lists them understands
    # DEVICE, GROUP, COLLECTIVE, EXPORT and IMPORT.
    devices: tuple[tuple[str, str], ...] = ()
    server_id: bytes = b""  # random per server process: two URLs of one server compare equal

    def frame(self) -> bytes:
        d = asdict(self)
        d["compress"] = list(self.compress)
        d["kept"] = list(self.kept)
        d["devices"] = [list(pair) for pair in self.devices]
        return welcome_frame(d)

    @property
    def device_list(self) -> tuple[tuple[str, str], ...]:
        """The server's devices, in index order (one for an older server)."""
        return self.devices or ((self.device, self.device_name),)

    @classmethod
    def parse(cls, frame: bytes, limits: Limits = DEFAULT_LIMITS) -> Welcome | Refusal:
        d = parse_handshake(frame, Frame.WELCOME, limits)
        if "refused" in d:
            return Refusal(d["refused"], d["message"])
        lane = d.get("lane")
        offer = None
        if type(lane) is dict and type(lane.get("path")) is str and type(lane.get("key")) is bytes:
            offer = LaneOffer(lane["path"], lane["key"])
        compress = d.get("compress") or ()
        return cls(
            server=str(d.get("server", "?")),
            torch=str(d.get("torch", "?")),
            session=_typed(d, "session", (bytes,), b""),
            device=str(d.get("device", "?")),
            device_name=str(d.get("device_name", "?")),
            max_message=_typed(d, "max_message", (int,), DEFAULT_LIMITS.max_message),
            max_chunk=_typed(d, "max_chunk", (int,), DEFAULT_LIMITS.max_chunk),
            resumed=bool(d.get("resumed", False)),
            last_seq=_typed(d, "last_seq", (int,), 0),
            compress=tuple(str(c) for c in compress) if type(compress) is list else (),
            lane=offer,
            protocol=_typed(d, "protocol", (int,), PROTOCOL_VERSION),
            name=_typed(d, "name", (str,), None),
            attached=bool(d.get("attached", False)),
            kept=tuple(str(k) for k in kept) if type(kept := d.get("kept")) is list else (),
            peek=d.get("peek") is True,
            devices=_device_pairs(d.get("devices")),
            server_id=_typed(d, "server_id", (bytes,), b""),
        )


def _device_pairs(value: Any) -> tuple[tuple[str, str], ...]:
    if type(value) is not list:
        return ()
    pairs = []
    for pair in value:
        if type(pair) is not list or len(pair) != 2 or not all(type(x) is str for x in pair):
            raise ProtocolError("WELCOME's devices must be [device, name] pairs")
        pairs.append((pair[0], pair[1]))
    return tuple(pairs)


class RefusalCode(str, Enum):
    """Why a server refused a HELLO (the REFUSE frame's code)."""

    PROTOCOL = "protocol"  # another protocol version
    CLOSING = "closing"  # the server is shutting down
    SESSION_LOST = "session-lost"  # the session to resume is gone
    FULL = "full"  # --max-sessions reached
    IN_USE = "session-in-use"  # a named session another client holds
    BAD_NAME = "bad-name"  # not a session name


@dataclass(frozen=True)
class Refusal:
    """A REFUSE frame: a `RefusalCode` value and a message for the user."""

    code: str
    message: str

    def frame(self) -> bytes:
        return refuse_frame(self.code, self.message)


def refuse_protocol(client_version: Any) -> Refusal:
    return Refusal(
        RefusalCode.PROTOCOL.value,
        f"this server speaks rgpu protocol {PROTOCOL_VERSION}, the client sent {client_version!r}",
    )


def refuse_closing() -> Refusal:
    return Refusal(RefusalCode.CLOSING.value, "the rgpu server is shutting down")


def refuse_full(max_sessions: int) -> Refusal:
    return Refusal(
        RefusalCode.FULL.value,
        f"the rgpu server already serves its maximum of {max_sessions} sessions",
    )


def session_lost_message(url: str, why: str | None = None) -> str:
    """Why a resume failed; the server says it in REFUSE, the client when WELCOME says not
    resumed. `why`: what the server knows of a named session's end."""
    cause = why or ("it restarted, or the session expired while the connection was down")
    return (
        f"the rgpu server at {url} no longer has this session ({cause}): every rgpu tensor of "
        "the session is gone. Call rgpu.connect() to start a new session."
    )


def refuse_in_use(name: str, since: str) -> Refusal:
    return Refusal(
        RefusalCode.IN_USE.value,
        f"the session {name!r} is in use by another client (connected {since}); close it there, "
        f"or connect with takeover=True (%rgpu connect ... --session {name} --takeover) to take "
        "it over (that client then gets SessionLost)",
    )


NAME_RULE = "1 to 64 letters, digits, '.', '_' or '-'"


def valid_session_name(name: str) -> bool:
    return (
        0 < len(name) <= 64
        and name.replace("-", "").replace("_", "").replace(".", "").isalnum()
        and name.isascii()
    )


def refuse_bad_name(name: str) -> Refusal:
    return Refusal(RefusalCode.BAD_NAME.value, f"{name!r} is not a session name: use {NAME_RULE}")


def refuse_session_lost(url: str, why: str | None = None) -> Refusal:
    return Refusal(RefusalCode.SESSION_LOST.value, session_lost_message(url, why))


# -- the frames themselves ------------------------------------------------------------------------


def hello_frame(info: dict) -> bytes:
    return bytes((Frame.HELLO,)) + msgpack.packb(info, use_bin_type=True)


def welcome_frame(info: dict) -> bytes:
    return bytes((Frame.WELCOME,)) + msgpack.packb(info, use_bin_type=True)


def refuse_frame(code: str, message: str) -> bytes:
    return bytes((Frame.REFUSE,)) + msgpack.packb({"code": code, "message": message})


def parse_handshake(frame: bytes, expect: Frame, limits: Limits = DEFAULT_LIMITS) -> dict:
    """Decode HELLO or WELCOME; a REFUSE frame is returned as {"refused": ..., "message": ...}."""
    kind = frame_kind(frame)
    value = unpack_one(memoryview(frame)[1:], limits)
    if type(value) is not dict:
        raise ProtocolError("handshake frame must hold a map")
    if kind == Frame.REFUSE:
        return {"refused": str(value.get("code")), "message": str(value.get("message"))}
    if kind != expect:
        raise ProtocolError(f"expected a {expect.name} frame, got {kind.name}")
    return value


def torch_major_minor(version: str) -> tuple[int, int] | None:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def version_mismatch(client_torch: str, server_torch: str) -> str | None:
    """A message when the two torch releases differ in major.minor, else None."""
    a, b = torch_major_minor(client_torch), torch_major_minor(server_torch)
    if a is not None and a == b:
        return None
    return (
        f"torch versions differ: this client runs torch {client_torch}, the rgpu server runs torch "
        f"{server_torch}. Operator schemas change between releases, so both must run the same "
        f"major.minor. Install torch {'.'.join(map(str, b)) if b else server_torch} here (or match the "
        f"server to this client), or set RGPU_ALLOW_VERSION_MISMATCH=1 to connect anyway at your own risk."
    )
