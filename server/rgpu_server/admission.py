"""Who may open a connection, decided before any session exists: browsers never, other rgpu
servers with a one-time capability, clients with a token, lanes with their session's key."""

from __future__ import annotations

import hashlib
import hmac
import http
import logging
import ssl
from typing import Any

from websockets.asyncio.server import ServerConnection

from rgpu_protocol.lane import KEY_HEADER, LANE_PATH, SESSION_HEADER

from . import peers

log = logging.getLogger("rgpu_server")


def owner_of(token: str) -> str:
    """Who a token is, as sessions and the state directory record it (never the token)."""
    return hashlib.sha256(token.encode()).hexdigest()[:32]


def ssl_context(certfile: str | None, keyfile: str | None) -> ssl.SSLContext | None:
    if not certfile:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(certfile, keyfile)
    return ctx


def authorize(
    token: str | None, tokens: tuple[str, ...], registry: Any, connection: ServerConnection, request
):
    """Refuse a missing or wrong token before any session exists (constant-time compare)."""
    if request.headers.get("Origin") is not None:
        # rgpu clients never send one; browsers always do: refuse pages that a user's browser
        # visits from talking to this server (cross-site websocket hijacking)
        return connection.respond(
            http.HTTPStatus.FORBIDDEN, "rgpu-server: browsers may not connect\n"
        )
    if peers.is_peer(request):  # another rgpu server: a one-time capability, not a token
        return peers.authorize(connection, request)
    if token is None:
        return _authorize_lane(registry, connection, request)
    header = request.headers.get("Authorization", "")
    given = header[7:] if header.startswith("Bearer ") else ""
    matched = None
    for candidate in (token, *tokens):
        if hmac.compare_digest(given.encode(), candidate.encode()):
            matched = candidate
    if matched is None:
        peer = "{}:{}".format(*connection.remote_address[:2]) if connection.remote_address else "?"
        log.warning("refused %s: %s token", peer, "wrong" if given else "no")
        return connection.respond(
            http.HTTPStatus.UNAUTHORIZED,
            "rgpu-server: missing or wrong token. Pass it with rgpu.connect(url, token=...), "
            "RGPU_TOKEN, or ?token=... in the URL.\n",
        )
    connection.rgpu_owner = owner_of(matched)  # whose sessions this connection may reach
    return _authorize_lane(registry, connection, request)


def _authorize_lane(registry: Any, connection: ServerConnection, request):
    """A lane must name a live session and carry that session's lane key."""
    if request.path.split("?")[0] != LANE_PATH:
        return None
    try:
        session = registry.by_id.get(bytes.fromhex(request.headers.get(SESSION_HEADER, "")))
        key = bytes.fromhex(request.headers.get(KEY_HEADER, ""))
    except ValueError:
        session, key = None, b""
    if session is None or session.ended or not hmac.compare_digest(key, session.lane_key):
        return connection.respond(
            http.HTTPStatus.FORBIDDEN,
            "rgpu-server: a lane needs the id and lane key of a live session\n",
        )
    return None
