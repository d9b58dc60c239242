"""The websocket server: handshake, one `Session` per connection, frames in and out.

All of this runs on one asyncio loop and only moves bytes; decoding and execution happen on each
session's worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import os
import platform
import secrets
from dataclasses import dataclass, field

import torch
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from rgpu.protocol import (
    DEFAULT_LIMITS,
    PROTOCOL_VERSION,
    CloseCode,
    Frame,
    Limits,
    ProtocolError,
    parse_handshake,
    refuse_frame,
    torch_major_minor,
    welcome_frame,
)

from . import __version__, kernels
from .session import Session

log = logging.getLogger("rgpu_server")

HELLO_TIMEOUT = 10.0
MAX_BACKLOG = 256 << 20  # bytes received but not yet executed, per session, before reading pauses


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return "Apple MPS"
    cpu = platform.processor() or platform.machine() or "cpu"
    return f"CPU ({cpu}, {os.cpu_count()} cores)"


def pick_device(spec: str | None) -> torch.device:
    """Turn --device into a torch.device and prove it works by allocating on it."""
    if spec in (None, "", "auto"):
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(spec)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda", "mps"):
        raise SystemExit(f"rgpu-server: --device must be cpu, cuda, cuda:N or mps, not {spec!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("rgpu-server: --device cuda was asked for, but this torch sees no CUDA GPU")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.index >= torch.cuda.device_count():
            raise SystemExit(f"rgpu-server: {device} does not exist; this host has {torch.cuda.device_count()} GPU(s)")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise SystemExit("rgpu-server: --device mps was asked for, but MPS is not available here")
    torch.empty(1, device=device)
    kernels.install(device)
    return device


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 9720
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    limits: Limits = DEFAULT_LIMITS


class RgpuServer:
    """Accepts websocket connections and gives each its own `Session`."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.sessions: dict[bytes, Session] = {}
        self.port: int | None = None
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def url(self) -> str:
        host = self.config.host
        if ":" in host:
            host = f"[{host}]"
        return f"ws://{host}:{self.port}"

    def stop(self) -> None:
        """Ask the server to stop; safe from any thread."""
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)

    async def run(self, on_ready=None) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        limits = self.config.limits
        async with serve(
            self._handle,
            self.config.host,
            self.config.port,
            compression=None,
            max_size=limits.max_message,
            max_queue=16,
            ping_interval=20,
            ping_timeout=60,
            server_header=f"rgpu-server/{__version__}",
        ) as server:
            self.port = next(iter(server.sockets)).getsockname()[1]
            log.info(
                "rgpu-server %s listening on %s (device %s: %s, torch %s)",
                __version__, self.url, self.config.device, device_name(self.config.device), torch.__version__,
            )  # fmt: skip
            if on_ready is not None:
                on_ready(self)
            await self._stop.wait()
            log.info("rgpu-server stopping")
        for s in list(self.sessions.values()):
            s.stop()

    # -- one connection ------------------------------------------------------------------------

    async def _handle(self, ws: ServerConnection) -> None:
        peer = "%s:%s" % ws.remote_address[:2] if ws.remote_address else "?"
        try:
            first = await asyncio.wait_for(ws.recv(), HELLO_TIMEOUT)
            if isinstance(first, str):
                raise ProtocolError("the handshake must be a binary frame")
            hello = parse_handshake(first, Frame.HELLO, self.config.limits)
        except (TimeoutError, asyncio.TimeoutError):
            await ws.close(CloseCode.BAD_HELLO, "no HELLO within 10 s")
            return
        except ProtocolError as e:
            await ws.close(CloseCode.BAD_HELLO, f"bad HELLO: {e}"[:120])
            return
        except ConnectionClosed:
            return
        if hello.get("protocol") != PROTOCOL_VERSION:
            msg = f"this server speaks rgpu protocol {PROTOCOL_VERSION}, the client sent {hello.get('protocol')!r}"
            await ws.send(refuse_frame("protocol", msg))
            await ws.close(CloseCode.VERSION_MISMATCH, "protocol version mismatch")
            return
        client_torch = str(hello.get("torch", "?"))
        if torch_major_minor(client_torch) != torch_major_minor(torch.__version__):
            log.warning("client %s runs torch %s, this server torch %s", peer, client_torch, torch.__version__)
        session = Session(secrets.token_bytes(16), self.config.device, self.config.limits, client=peer)
        self.sessions[session.id] = session
        loop = asyncio.get_running_loop()
        await ws.send(
            welcome_frame(
                {
                    "protocol": PROTOCOL_VERSION,
                    "server": __version__,
                    "torch": torch.__version__,
                    "session": session.id,
                    "resumed": False,
                    "last_seq": 0,
                    "device": str(self.config.device),
                    "device_name": device_name(self.config.device),
                    "max_message": self.config.limits.max_message,
                    "max_chunk": min(self.config.limits.max_chunk, self.config.limits.max_message // 2),
                }
            )
        )
        log.info("session %s started for %s (%s, torch %s)", session.hex, peer, hello.get("client", "?"), client_torch)

        async def send_frames(frames: list) -> None:
            for f in frames:
                await ws.send(f)

        def send(frames: list) -> None:  # called from the session's worker thread
            fut = asyncio.run_coroutine_threadsafe(send_frames(frames), loop)
            try:
                fut.result()
            except Exception:
                pass  # the connection is gone; the reader side ends the session

        def on_protocol_error(reason: str) -> None:
            asyncio.run_coroutine_threadsafe(ws.close(CloseCode.PROTOCOL_ERROR, reason[:120]), loop)

        session.send = send
        session.on_protocol_error = on_protocol_error
        received = 0
        try:
            async for frame in ws:
                if isinstance(frame, str):
                    await ws.close(CloseCode.PROTOCOL_ERROR, "rgpu frames are binary")
                    break
                received += len(frame)
                session.inbox.put(frame)
                while received - session.processed > MAX_BACKLOG and session.alive():
                    await asyncio.sleep(0.002)
        except ConnectionClosed:
            pass
        finally:
            session.send = None
            session.stop()
            self.sessions.pop(session.id, None)
            log.info(
                "session %s ended for %s after %d ops (%s)",
                session.hex, peer, session.ops_run, ws.close_reason or "closed",
            )  # fmt: skip
