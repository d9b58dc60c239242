"""EXPORT and IMPORT: copying a tensor from this server to another rgpu server, or from another
one to this, without the bytes passing through the client (rgpu_protocol/peer.py).

EXPORT runs on the source session's worker: it snapshots the tensor's bytes at that point of the
stream (later ops may change the tensor) and publishes them under the client's one-time
capability. IMPORT runs on the destination session's worker: it opens a websocket to the
source's `PEER_PATH` with the capability and copies what arrives into its tensor. The source's
event loop answers that connection (`serve_peer`), waiting for the export to be published if
the source's stream has not reached it yet. No token is needed on that path: the 128-bit
capability, which only the client that holds both sessions knows, authorizes one fetch of one
tensor.
"""

from __future__ import annotations

import asyncio
import http
import logging
import time
from typing import Any

import torch
from websockets.asyncio.server import ServerConnection
from websockets.sync.client import connect

from rgpu_protocol import byte_view
from rgpu_protocol.peer import (
    CAPABILITY_BYTES,
    CAPABILITY_HEADER,
    EXPORT_TTL_S,
    EXPORT_WAIT_S,
    PEER_CHUNK,
    PEER_PATH,
    PeerRefused,
    parse_peer_header,
    peer_error,
    peer_header,
)

from .poison import Poison, describe
from .state import SessionState

log = logging.getLogger("rgpu_server")
MAX_WAITING = 64  # peer connections waiting for their export at once


class Exports:
    """Snapshots waiting to be fetched, by capability. Lives on the event loop; workers publish
    through `publish_threadsafe`."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self._ready: dict[bytes, Any] = {}  # capability -> CPU tensor, or an error message
        self._waiting: dict[bytes, asyncio.Future] = {}

    def publish_threadsafe(self, capability: bytes, value: Any) -> None:
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._publish, capability, value)

    def _publish(self, capability: bytes, value: Any) -> None:
        waiter = self._waiting.pop(capability, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(value)
            return
        self._ready[capability] = value
        self.loop.call_later(EXPORT_TTL_S, self._ready.pop, capability, None)

    async def take(self, capability: bytes) -> Any:
        """The export under `capability`, once published (None after EXPORT_WAIT_S)."""
        if capability in self._ready:
            return self._ready.pop(capability)
        if len(self._waiting) >= MAX_WAITING or capability in self._waiting:
            return None
        waiter = self._waiting[capability] = self.loop.create_future()
        try:
            return await asyncio.wait_for(waiter, EXPORT_WAIT_S)
        except (TimeoutError, asyncio.TimeoutError):
            return None
        finally:
            self._waiting.pop(capability, None)


EXPORTS = Exports()


def capability_of(request: Any) -> bytes | None:
    """The capability a peer connection presents, if it is well-formed."""
    try:
        cap = bytes.fromhex(request.headers.get(CAPABILITY_HEADER, ""))
    except ValueError:
        return None
    return cap if len(cap) == CAPABILITY_BYTES else None


def is_peer(request: Any) -> bool:
    return request.path.split("?")[0] == PEER_PATH


def authorize(connection: ServerConnection, request: Any) -> Any:
    """A peer fetch is let in with a well-formed capability; whether it names an export is
    only known once the export is published (serve_peer waits for it)."""
    if capability_of(request) is None:
        return connection.respond(
            http.HTTPStatus.FORBIDDEN, "rgpu-server: a peer fetch needs a capability\n"
        )
    return None


async def serve_peer(ws: ServerConnection, peer: str) -> None:
    """Send one export to the server that fetches it: a header frame, then the bytes."""
    cap = capability_of(ws.request)
    value = await EXPORTS.take(cap) if cap is not None else None
    if value is None:
        await ws.send(peer_error("no tensor was exported under this capability (it expired, "
                                 "was fetched already, or never existed)"))  # fmt: skip
        await ws.close()
        return
    if isinstance(value, str):
        await ws.send(peer_error(value))
        await ws.close()
        return
    data = byte_view(value)
    await ws.send(peer_header(value.dtype, tuple(value.shape), len(data)))
    for off in range(0, len(data), PEER_CHUNK):
        await ws.send(data[off : off + PEER_CHUNK])
    await ws.wait_closed()  # the fetching server closes once it has everything
    log.info("sent an exported tensor of %d bytes to %s", len(data), peer)


def export(s: SessionState, seq: int, msg: list) -> None:
    """EXPORT [src, capability]: publish a snapshot of src's bytes."""
    _, src, cap = msg
    if len(cap) != CAPABILITY_BYTES:
        s.fail("export", f"a capability is {CAPABILITY_BYTES} bytes", ())
        return
    if s.bad is not None:
        bad = s.bad
        EXPORTS.publish_threadsafe(cap, bad.message if type(bad) is Poison else
                                   f"the source tensor {bad} does not exist")  # fmt: skip
        return
    if not isinstance(src, torch.Tensor):
        EXPORTS.publish_threadsafe(cap, "EXPORT needs a tensor reference")
        return
    t = src.detach().resolve_conj().resolve_neg()
    snapshot = t.cpu() if t.device.type != "cpu" else t
    snapshot = snapshot.contiguous()
    if snapshot.data_ptr() == t.data_ptr():
        snapshot = snapshot.clone()  # later ops of this stream may change t
    EXPORTS.publish_threadsafe(cap, snapshot)


def import_(s: SessionState, seq: int, msg: list) -> None:
    """IMPORT [dst, url, capability]: fetch an export from another server into dst."""
    _, dst, url, cap = msg
    ids = list(s.refs.values())
    if s.bad is not None:
        s.pass_on_bad("import", ids)
        return
    if not isinstance(dst, torch.Tensor):
        s.fail("import", "IMPORT needs a tensor reference", ids)
        return
    started = time.perf_counter()
    try:
        host = fetch(url, cap, max(dst.numel(), 1) * 16)  # copy_ may cast, or broadcast
        with torch.no_grad():
            dst.copy_(host)
    except Exception as e:
        s.fail("import", describe(e), ids)
        return
    log.info("session %s imported %d bytes from %s in %.3f s", s.hex,
             host.numel() * host.element_size(), url, time.perf_counter() - started)  # fmt: skip


def fetch(url: str, capability: bytes, max_bytes: int) -> torch.Tensor:
    """The tensor another server exported under `capability`, as a CPU tensor."""
    peer_url = url.rstrip("/") + PEER_PATH
    with connect(
        peer_url,
        additional_headers={CAPABILITY_HEADER: capability.hex()},
        compression=None,
        max_size=PEER_CHUNK + (1 << 16),
        open_timeout=30,
        close_timeout=5,
    ) as ws:
        try:
            dtype, shape, size = parse_peer_header(ws.recv(EXPORT_WAIT_S + 30), max_bytes)
        except PeerRefused as e:
            raise RuntimeError(f"the source server refused the copy: {e}") from None
        buf = torch.empty(size, dtype=torch.uint8)
        view = byte_view(buf)
        got = 0
        while got < size:
            chunk = ws.recv(60)
            if not isinstance(chunk, bytes) or got + len(chunk) > size:
                raise RuntimeError("the source server sent more bytes than it announced")
            view[got : got + len(chunk)] = chunk
            got += len(chunk)
    return buf.view(dtype).reshape(shape) if size else torch.empty(shape, dtype=dtype)
