"""The websocket server: authentication, handshake, sessions that survive dropped connections.

All of this runs on one asyncio loop and only moves bytes; decoding and execution happen on each
session's worker thread. A session outlives its connection for a grace period, so a client whose
link drops reconnects, resumes the session by id and replays what the server had not applied.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from rgpu_protocol import (
    DEFAULT_LIMITS,
    PROTOCOL_VERSION,
    CloseCode,
    Frame,
    Hello,
    LaneOffer,
    Limits,
    ProtocolError,
    Welcome,
    parse_cancel,
    parse_peek,
    peek_reply_frame,
    torch_major_minor,
)
from rgpu_protocol.handshake import (
    refuse_closing,
    refuse_protocol,
)
from rgpu_protocol.lane import LANE_PATH, SESSION_HEADER

from . import __version__, admission, multidevice, peers
from .datadirs import DataRoots
from .devices import device_name
from .durable import DurableStore
from .lane import ServerLane, serve_lane
from .outbox import Outbox
from .registry import SessionRegistry
from .session import Session

log = logging.getLogger("rgpu_server")

HELLO_TIMEOUT = 10.0
_CANCEL = bytes((Frame.CANCEL,))
_PEEK = bytes((Frame.PEEK,))
MAX_BACKLOG = 256 << 20  # bytes received but not yet executed, per session, before reading pauses
LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 9720
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    limits: Limits = DEFAULT_LIMITS
    token: str | None = None  # None: no authentication (loopback only)
    tokens: tuple[str, ...] = ()  # more tokens: each is its own owner of sessions
    detached_ttl: float = 86400.0  # seconds a named session outlives its client
    max_detached: int | None = None  # bytes detached named sessions may hold together
    state_dir: str | None = None  # durable kept objects (durable.py)
    certfile: str | None = None
    keyfile: str | None = None
    grace: float = 120.0  # seconds a session waits for its client to reconnect
    max_sessions: int = 64
    quota: int | None = None  # bytes of tensor storage one session may hold
    profile_dir: str | None = None  # a cProfile dump per session goes here (developer aid)
    data: DataRoots | None = None  # --data-dir roots (files.py)
    devices: tuple[torch.device, ...] = ()  # every device, by rgpu index (empty: just `device`)

    @property
    def all_devices(self) -> tuple[torch.device, ...]:
        return self.devices or (self.device,)


class RgpuServer:
    """Accepts websocket connections; gives each client a `Session` that can be resumed."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.registry = SessionRegistry(
            self._make_session,
            grace=config.grace,
            detached_ttl=config.detached_ttl,
            max_sessions=config.max_sessions,
            max_detached=config.max_detached,
        )
        self.store = DurableStore(Path(config.state_dir)) if config.state_dir else None
        if self.store is not None:
            restored = self.registry.restore(self.store)
            if restored:
                log.info("restored %d named session(s) from %s", restored, config.state_dir)
        self.port: int | None = None
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._connections: set[ServerConnection] = set()
        self._outboxes: dict[ServerConnection, Outbox] = {}
        self._closing = False
        self._lanes: set[ServerLane] = set()
        self.server_id = secrets.token_bytes(8)  # lets a client see two URLs are one server
        self.described = multidevice.describe(config.all_devices)

    @property
    def scheme(self) -> str:
        return "wss" if self.config.certfile else "ws"

    @property
    def url(self) -> str:
        host = self.config.host
        if ":" in host:
            host = f"[{host}]"
        return f"{self.scheme}://{host}:{self.port}"

    def info(self) -> dict:
        """Server-wide counts (for INFO): sessions, and the tensors and bytes they hold."""
        tensors = nbytes = 0
        for s in self.registry.sessions():
            count, held = s.memory()
            tensors += count
            nbytes += held
        data = self.config.data
        return {
            "sessions": len(self.registry),
            "tensors": tensors,
            "bytes": nbytes,
            "data_dirs": data.describe() if data is not None else [],
        }

    def stop(self) -> None:
        """Ask the server to stop (finish in-flight work, then close); safe from any thread."""
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)

    def _authorize(self, connection: ServerConnection, request):
        return admission.authorize(self.config.token, self.config.tokens, self.registry,
                                   connection, request)  # fmt: skip

    async def run(self, on_ready=None) -> None:
        self._loop = asyncio.get_running_loop()
        peers.EXPORTS.loop = self._loop
        self.registry.loop = self._loop
        self.registry.close = lambda ws, code, reason: asyncio.ensure_future(
            ws.close(code, reason[:120])
        )
        self._stop = asyncio.Event()
        limits = self.config.limits
        reaper = asyncio.create_task(self._reap())
        async with serve(
            self._handle,
            self.config.host,
            self.config.port,
            ssl=admission.ssl_context(self.config.certfile, self.config.keyfile),
            process_request=self._authorize,
            compression=None,
            max_size=limits.max_message,
            max_queue=16,
            ping_interval=20,
            ping_timeout=60,
            server_header=f"rgpu-server/{__version__}",
        ) as server:
            self.port = next(iter(server.sockets)).getsockname()[1]
            log.info(
                "rgpu-server %s listening on %s (%s, torch %s)", __version__, self.url,
                f"device {self.described[0][0]}: {self.described[0][1]}" if len(self.described) == 1
                else "; ".join(f"rgpu:{i} = {d}: {n}" for i, (d, n) in enumerate(self.described)),
                torch.__version__,
            )  # fmt: skip
            if on_ready is not None:
                on_ready(self)
            await self._stop.wait()
            await self._shutdown(server)
        reaper.cancel()
        for s in self.registry.expired:
            s.join(10)

    async def _shutdown(self, server) -> None:
        """Stop taking sessions, let in-flight work finish, then close with "going away"."""
        self._closing = True
        log.info(
            "rgpu-server stopping: finishing in-flight work of %d session(s)", len(self.registry)
        )
        server.close(close_connections=False)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(not s.idle() for s in self.registry.sessions()):
            await asyncio.sleep(0.05)
        for lane in list(self._lanes):
            lane.close()
        for ws in list(self._connections):
            outbox = self._outboxes.get(ws)
            if outbox is not None:
                await outbox.flushed(5)
            await ws.close(
                CloseCode.GOING_AWAY, "rgpu-server is shutting down; its tensors are gone"
            )
        sessions = self.registry.sessions()
        for s in sessions:
            s.stop()
        # Wait for the worker threads to end before the interpreter does: a daemon thread still
        # inside a torch call when Python finalizes is unwound through C++ frames, and the
        # process aborts with "terminate called without an active exception".
        loop = asyncio.get_running_loop()
        for s in sessions:
            await loop.run_in_executor(None, s.join, 10)
        self.registry.by_id.clear()
        self.registry.by_name.clear()
        log.info("rgpu-server stopped")

    async def _reap(self) -> None:
        """End sessions whose client has not come back in time (registry.py)."""
        while True:
            await asyncio.sleep(min(1.0, self.config.grace / 4))
            self.registry.reap(time.monotonic())

    # -- one connection ------------------------------------------------------------------------

    async def _handle(self, ws: ServerConnection) -> None:
        peer = "{}:{}".format(*ws.remote_address[:2]) if ws.remote_address else "?"
        if ws.request is not None and peers.is_peer(ws.request):
            await peers.serve_peer(ws, peer)
            return
        if ws.request is not None and ws.request.path.split("?")[0] == LANE_PATH:
            session = self.registry.by_id.get(bytes.fromhex(ws.request.headers[SESSION_HEADER]))
            if session is not None and not session.ended:
                await serve_lane(ws, session, peer, self._lanes)
            return
        try:
            first = await asyncio.wait_for(ws.recv(), HELLO_TIMEOUT)
            if isinstance(first, str):
                raise ProtocolError("the handshake must be a binary frame")
            hello = Hello.parse(first, self.config.limits)
        except (TimeoutError, asyncio.TimeoutError):
            await ws.close(CloseCode.BAD_HELLO, "no HELLO within 10 s")
            return
        except ProtocolError as e:
            await ws.close(CloseCode.BAD_HELLO, f"bad HELLO: {e}"[:120])
            return
        except ConnectionClosed:
            return
        if hello.protocol != PROTOCOL_VERSION:
            await ws.send(refuse_protocol(hello.protocol).frame())
            await ws.close(CloseCode.VERSION_MISMATCH, "protocol version mismatch")
            return
        if self._closing:
            await ws.send(refuse_closing().frame())
            await ws.close(CloseCode.GOING_AWAY, "shutting down")
            return
        owner = getattr(ws, "rgpu_owner", "")
        opened = self.registry.open(hello, owner, peer, self.url)
        if opened.refusal is not None:
            await ws.send(opened.refusal.frame())
            await ws.close(
                CloseCode.GOING_AWAY if opened.refusal.code == "full" else CloseCode.BYE,
                opened.refusal.code,
            )
            return
        session, resumed = opened.session, opened.resumed
        if not resumed and torch_major_minor(hello.torch) != torch_major_minor(torch.__version__):
            log.warning("client %s runs torch %s, this server torch %s", peer, hello.torch,
                        torch.__version__)  # fmt: skip
        if opened.evict is not None:
            await opened.evict.close(CloseCode.TAKEN_OVER, "another client took the session over")
        loop = asyncio.get_running_loop()

        outbox = Outbox(ws, loop)
        send = outbox.send  # called from the session's worker thread

        async def close_after_replies(reason: str) -> None:
            await outbox.flushed(5)  # the error reply the worker sent goes out first
            await ws.close(CloseCode.PROTOCOL_ERROR, reason[:120])

        def on_protocol_error(reason: str) -> None:
            asyncio.run_coroutine_threadsafe(close_after_replies(reason), loop)

        # the WELCOME goes out before this connection can receive any reply
        limits = self.config.limits
        welcome = Welcome(
            server=__version__,
            torch=torch.__version__,
            session=session.id,
            device=str(self.config.device),
            device_name=device_name(self.config.device),
            max_message=limits.max_message,
            max_chunk=min(limits.max_chunk, limits.max_message // 2),
            resumed=resumed,
            last_seq=session.last_seq if resumed else 0,
            compress=("zlib",),  # BATCH_Z frames are understood
            lane=LaneOffer(LANE_PATH, session.lane_key),
            name=session.name,
            attached=opened.attached,
            kept=tuple(sorted(session.kept)),
            peek=True,
            devices=self.described,
            server_id=self.server_id,
        )
        await ws.send(welcome.frame())
        old_ws = self.registry.connection.get(session.id)
        generation = session.attach(send, on_protocol_error)
        self.registry.connection[session.id] = ws
        if old_ws is not None and old_ws is not ws:
            await old_ws.close(CloseCode.SUPERSEDED, "the session resumed on a newer connection")
        self._connections.add(ws)
        self._outboxes[ws] = outbox
        if resumed:
            log.info("session %s resumed by %s at message %d", session.hex, peer, session.last_seq)
        elif not opened.attached:
            log.info(
                "session %s%s started for %s (%s, torch %s)",
                session.hex,
                f" ({session.name!r})" if session.name else "",
                peer,
                hello.client,
                hello.torch,
            )
        received = session.processed
        try:
            async for frame in ws:
                if self._closing:
                    continue  # shutting down: finish what arrived before, take nothing new
                if isinstance(frame, str):
                    session.stop()  # a protocol error ends the session, as in the worker
                    await ws.close(CloseCode.PROTOCOL_ERROR, "rgpu frames are binary")
                    break
                if frame[:1] == _CANCEL:  # out of band: the worker must see it before the work
                    upto = parse_cancel(frame)
                    session.stream.cancel(upto)
                    log.info("session %s: interrupt: work up to message %d not started yet is "
                             "cancelled", session.hex, upto)  # fmt: skip
                    continue
                if frame[:1] == _PEEK:  # out of band: live facts now, not behind queued work
                    facts = await asyncio.to_thread(session.peek)
                    await ws.send(peek_reply_frame(parse_peek(frame), facts))
                    continue
                received += len(frame)
                session.put(generation, frame)
                while received - session.processed > MAX_BACKLOG and session.alive():
                    await asyncio.sleep(0.002)
        except ConnectionClosed:
            pass
        finally:
            self._connections.discard(ws)
            self._outboxes.pop(ws, None)
            self._connection_ended(ws, session, generation, peer)

    def _connection_ended(self, ws: ServerConnection, session: Session, generation: int, peer: str):
        if self.registry.connection.get(session.id) is ws:
            del self.registry.connection[session.id]
        code = ws.close_code
        current = session.generation == generation
        if code == CloseCode.BYE and not session.ended and current:
            # the client ended its session on purpose (a named one too): nothing to resume
            self.registry.end(session, "its client ended it")
            if session.store is not None and session.name is not None:
                session.store.forget(session.owner, session.name)
            log.info("session %s ended for %s after %d ops", session.hex, peer, session.ops_run)
            return
        session.detach(generation)
        if not session.ended and not self._closing and current:
            named = session.name is not None
            kept = self.config.detached_ttl if named else self.config.grace
            log.info(
                "session %s%s %s %s (%s); kept %.0f s for %s",
                session.hex, f" ({session.name!r})" if named else "",
                "detached from" if code == CloseCode.KEEP else "lost its connection from",
                peer, ws.close_reason or f"code {code}", kept,
                "a later client" if named else "a resume",
            )  # fmt: skip

    def _make_session(self, sid: bytes, owner: str, name: str | None, peer: str) -> Session:
        session = Session(
            sid,
            self.config.device,
            self.config.limits,
            client=peer,
            quota=self.config.quota,
            profile_dir=self.config.profile_dir,
            owner=owner,
            name=name,
        )
        multidevice.setup(session, self.config.all_devices)
        session.server_info = self.info
        session.data = self.config.data
        session.registry = self.registry
        session.store = self.store
        return session
