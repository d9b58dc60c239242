"""The websocket to one rgpu server: connect, handshake, a reader thread, thread-safe sends.

This layer moves frames and nothing else; `rgpu.session` decides what they mean.
"""

from __future__ import annotations

import inspect
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

import torch
from websockets.exceptions import (
    ConnectionClosed,
    InvalidHandshake,
    InvalidStatus,
    InvalidURI,
    WebSocketException,
)
from websockets.sync.client import ClientConnection, connect

from rgpu_protocol import (
    DEFAULT_LIMITS,
    PROTOCOL_VERSION,
    CloseCode,
    Hello,
    ProtocolError,
    Refusal,
    RefusalCode,
    Welcome,
    session_lost_message,
    version_mismatch,
)

from ._version import __version__
from .config import DEFAULT, Config
from .errors import AuthError, ConnectError, SessionInUse, SessionLost

HANDSHAKE_TIMEOUT = 30.0


class _WideReadConnection(ClientConnection):
    """Reads the socket 1 MiB at a time instead of 64 KiB: big downloads cost fewer wakeups."""

    recv_bufsize = 1 << 20


_CONNECT_PARAMS = set(inspect.signature(connect).parameters)


def split_token(url: str) -> tuple[str, str | None]:
    """Take `?token=...` out of a URL: the token travels in a header, never in the request line."""
    parts = urllib.parse.urlsplit(url)
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    token = next((v for k, v in query if k == "token"), None)
    rest = urllib.parse.urlencode([(k, v) for k, v in query if k != "token"])
    path = "" if parts.path in ("", "/") and not rest else parts.path
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, rest, "")), token


def ssl_context(url: str, bundle: str | None = None) -> ssl.SSLContext | None:
    """Verify the server's certificate by default; `bundle` (RGPU_CA_BUNDLE) adds a private CA."""
    if not url.lower().startswith("wss://"):
        return None
    ctx = ssl.create_default_context()
    if bundle:
        ctx.load_verify_locations(cafile=bundle)
    return ctx


def _connect_kwargs(
    url: str, token: str | None, open_timeout: float, config: Config
) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "compression": None,  # tensor bytes do not compress; deflate made uploads 10x slower
        "max_size": DEFAULT_LIMITS.max_message,
        "max_queue": 16,
        "open_timeout": open_timeout,
        "ping_interval": 20,
        "ping_timeout": 60,
        "close_timeout": 5,
        "user_agent_header": f"rgpu/{__version__}",
    }
    if "create_connection" in _CONNECT_PARAMS:
        kwargs["create_connection"] = _WideReadConnection
    if "legacy" in _CONNECT_PARAMS:
        kwargs["legacy"] = True  # a long-lived connection kept on an object, not a with-block
    if "proxy" in _CONNECT_PARAMS:
        kwargs["proxy"] = config.proxy
    if token:
        kwargs["additional_headers"] = {"Authorization": f"Bearer {token}"}
    ctx = ssl_context(url, config.ca_bundle)
    if ctx is not None:
        kwargs["ssl"] = ctx
    return kwargs


class Connection:
    """An open, handshaken websocket plus the thread that reads it."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        on_frame: Callable[[bytes], None],
        on_close: Callable[[BaseException], None],
        open_timeout: float = 10.0,
        config: Config = DEFAULT,
        resume: bytes | None = None,
        name: str | None = None,
        takeover: bool = False,
    ) -> None:
        self.url = url
        try:
            self.ws = connect(url, **_connect_kwargs(url, token, open_timeout, config))
        except InvalidURI as e:
            raise ConnectError(
                f"{url!r} is not a websocket URL (expected ws://host:port or wss://host:port): {e}"
            ) from None
        except InvalidStatus as e:
            status = e.response.status_code
            if status in (401, 403):
                raise AuthError(
                    f"the rgpu server at {url} rejected the token (HTTP {status}): "
                    + ("none was sent. " if not token else "it is not the server's. ")
                    + "rgpu-server prints its token at start-up; pass it with rgpu.connect(url, "
                    "token=...), the RGPU_TOKEN environment variable, or ?token=... in the URL."
                ) from None
            raise ConnectError(f"{url} answered HTTP {status}; is that an rgpu server?") from None
        except ssl.SSLCertVerificationError as e:
            raise ConnectError(
                f"the TLS certificate of {url} could not be verified ({e.verify_message}). For a "
                "server with a private CA, set RGPU_CA_BUNDLE to the CA's certificate file."
            ) from None
        except (OSError, InvalidHandshake, TimeoutError, WebSocketException) as e:
            raise ConnectError(
                f"cannot reach an rgpu server at {url}: {e}. Start one with `rgpu-server` on the GPU "
                "host (and an SSH tunnel if it is remote), or use rgpu.connect('local')."
            ) from None
        try:
            hello_sent = time.perf_counter()
            hello = Hello(
                PROTOCOL_VERSION, torch.__version__, f"rgpu {__version__}", resume, name, takeover
            )
            self.ws.send(hello.frame())
            first = self.ws.recv(timeout=HANDSHAKE_TIMEOUT)
            if isinstance(first, str):
                raise ProtocolError("the server sent a text frame")
            # one round trip over the real path (through any tunnel or proxy): the link's RTT
            self.handshake_rtt_s = time.perf_counter() - hello_sent
            welcome = Welcome.parse(first)
        except (ConnectionClosed, ProtocolError, TimeoutError) as e:
            self.ws.close()
            raise ConnectError(
                f"the server at {url} did not complete the rgpu handshake: {e}"
            ) from None
        if isinstance(welcome, Refusal):
            self.ws.close()
            if welcome.code == RefusalCode.SESSION_LOST.value:
                raise SessionLost(welcome.message)
            if welcome.code == RefusalCode.IN_USE.value:
                raise SessionInUse(welcome.message)
            raise ConnectError(f"the rgpu server at {url} refused this client: {welcome.message}")
        if resume is not None and not welcome.resumed:
            self.ws.close(CloseCode.BYE)
            raise SessionLost(session_lost_message(url))
        problem = version_mismatch(torch.__version__, welcome.torch)
        if problem and not config.allow_version_mismatch:
            self.ws.close()
            raise ConnectError(problem)
        self.welcome = welcome
        self._on_frame = on_frame
        self._on_close = on_close
        self.closed = False
        self._reader = threading.Thread(target=self._read_loop, name="rgpu-reader", daemon=True)
        self._reader.start()

    def _read_loop(self) -> None:
        ws = self.ws
        while True:
            try:
                frame = ws.recv()
            except ConnectionClosed as e:
                self.closed = True
                self._on_close(e)
                return
            except Exception as e:  # anything else ends the connection too
                self.closed = True
                self._on_close(e)
                return
            if isinstance(frame, str):
                continue
            try:
                self._on_frame(frame)
            except Exception as e:
                self.closed = True
                self._on_close(e)
                ws.close()
                return

    def send(self, data: bytes | list) -> None:
        """Send one frame (a bytes, or a list of buffers sent as one fragmented message)."""
        self.ws.send(data)

    def close(self, code: int = CloseCode.BYE) -> None:
        """Close; the default code tells the server the session is over (nothing to resume)."""
        self.closed = True
        try:
            self.ws.close(code)
        except Exception:
            pass
        if threading.current_thread() is not self._reader:
            self._reader.join(timeout=5)
