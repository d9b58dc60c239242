"""Which sessions the server holds, by id and by name, and how long each outlives its client.

An unnamed session waits `--session-grace` seconds for its client to resume it after a dropped
connection. A *named* session (HELLO `name`) belongs to the token that made it and stays when its
client goes away — a kernel restart, a killed process, a laptop asleep — for `--detached-ttl`,
within `--max-detached-mb` for all such sessions together; a later client with the same token
re-opens it by name and finds what was kept in it (`rgpu.keep`). Only one client holds a named
session at a time; another is refused unless it asks to take over.

Runs on the event loop; worker threads reach it only through `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rgpu_protocol import CloseCode, Hello, Refusal
from rgpu_protocol.handshake import (
    refuse_bad_name,
    refuse_full,
    refuse_in_use,
    refuse_session_lost,
    valid_session_name,
)

from . import numerics
from .session import Session

log = logging.getLogger("rgpu_server")
TOMBSTONES = 1024  # why named sessions ended, kept to tell a client that comes back for one


@dataclass
class Opened:
    session: Session | None = None
    refusal: Refusal | None = None
    resumed: bool = False  # the same client, back after a dropped connection
    attached: bool = False  # a named session re-opened by a new client
    evict: Any = None  # the connection a takeover displaces


def since(t: float | None) -> str:
    if t is None:
        return "now"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(time.time() - (time.monotonic() - t)))


class SessionRegistry:
    def __init__(
        self,
        make: Callable[[bytes, str, str | None, str], Session],
        *,
        grace: float,
        detached_ttl: float,
        max_sessions: int,
        max_detached: int | None,
    ) -> None:
        self._make = make  # (id, owner, name, peer) -> a new Session
        self.grace = grace
        self.detached_ttl = detached_ttl
        self.max_sessions = max_sessions
        self.max_detached = max_detached
        self.by_id: dict[bytes, Session] = {}
        self.by_name: dict[tuple[str, str], Session] = {}
        self.connection: dict[bytes, Any] = {}  # session id -> the connection it runs on
        self.expired: list[Session] = []  # stopped sessions whose workers are ending
        self._gone: dict[tuple[str, str], str] = {}  # why a named session ended
        self.loop: Any = None  # the event loop (set by the server when it runs)
        self.close: Callable[[Any, int, str], None] | None = None  # closes a connection (app)

    def __len__(self) -> int:
        return len(self.by_id)

    def sessions(self) -> list[Session]:
        return list(self.by_id.values())

    # -- opening --------------------------------------------------------------------------------

    def open(self, hello: Hello, owner: str, peer: str, url: str) -> Opened:
        """The session a HELLO asks for: resumed by id, (re-)opened by name, or new."""
        if hello.session is not None:
            s = self.by_id.get(hello.session)
            if s is None or s.ended or s.owner != owner:
                why = self._gone.get((owner, hello.name)) if hello.name else None
                return Opened(refusal=refuse_session_lost(url, why))
            return Opened(s, resumed=True)
        if hello.name is not None:
            return self._open_named(hello, owner, peer, url)
        return self._new(owner, None, peer)

    def _new(self, owner: str, name: str | None, peer: str) -> Opened:
        if len(self.by_id) >= self.max_sessions:
            return Opened(refusal=refuse_full(self.max_sessions))
        s = self._make(secrets.token_bytes(16), owner, name, peer)
        self.by_id[s.id] = s
        if name is not None:
            self.by_name[(owner, name)] = s
            self._gone.pop((owner, name), None)
        return Opened(s)

    def _open_named(self, hello: Hello, owner: str, peer: str, url: str) -> Opened:
        name = hello.name or ""
        if not valid_session_name(name):
            return Opened(refusal=refuse_bad_name(name))
        s = self.by_name.get((owner, name))
        if s is None or s.ended:
            return self._new(owner, name, peer)
        evict = None
        if s.detached_at is None:  # a client holds it
            if not hello.takeover:
                return Opened(refusal=refuse_in_use(name, since(s.attached_at)))
            evict = self.connection.get(s.id)
        # a new client: it cannot know the old one's ids or stream; it gets a fresh id too, so
        # the old client (if alive) cannot resume into it
        del self.by_id[s.id]
        self.connection.pop(s.id, None)
        s.rename(secrets.token_bytes(16))
        self.by_id[s.id] = s
        s.reopen()
        log.info("session %s (%r) re-opened by %s%s", s.hex, name, peer,
                 " (taken over)" if evict is not None else "")  # fmt: skip
        return Opened(s, attached=True, evict=evict)

    # -- ending ---------------------------------------------------------------------------------

    def end(self, s: Session, why: str) -> None:
        """End a session now: its tensors and kept objects are freed."""
        if self.by_id.get(s.id) is s:
            del self.by_id[s.id]
        if s.name is not None and self.by_name.get((s.owner, s.name)) is s:
            del self.by_name[(s.owner, s.name)]
            self._gone[(s.owner, s.name)] = why
            while len(self._gone) > TOMBSTONES:
                self._gone.pop(next(iter(self._gone)))
        self.connection.pop(s.id, None)
        s.stop()
        self.expired.append(s)

    def why_gone(self, owner: str, name: str) -> str | None:
        return self._gone.get((owner, name))

    def reap(self, now: float) -> None:
        """End sessions whose client has not come back in time, and named ones past the memory
        that detached sessions may hold together."""
        self.expired = [s for s in self.expired if s.alive()]
        for s in self.sessions():
            if s.ended:
                self.end(s, "it ended")
                continue
            if s.detached_at is None:
                continue
            ttl = self.detached_ttl if s.name is not None else self.grace
            if now - s.detached_at > ttl:
                log.info("session %s%s expired after %.0f s without its client; its tensors are gone",
                         s.hex, f" ({s.name!r})" if s.name else "", ttl)  # fmt: skip
                self.end(s, f"it expired after {ttl:.0f} s without a client (--detached-ttl)")
        if self.max_detached is not None:
            self._fit_detached()

    def detached_bytes(self, but: Session | None = None) -> int:
        return sum(s.memory()[1] for s in self.sessions()
                   if s.name is not None and s.detached_at is not None and s is not but)  # fmt: skip

    def _fit_detached(self) -> None:
        """Past --max-detached-mb, the sessions detached longest ago are freed first."""
        named = sorted(
            (s for s in self.sessions() if s.name is not None and s.detached_at is not None),
            key=lambda s: s.detached_at,
        )
        held = sum(s.memory()[1] for s in named)
        for s in named:
            if held <= self.max_detached:
                break
            size = s.memory()[1]
            log.warning("session %s (%r) freed: detached sessions held %d bytes, over "
                        "--max-detached-mb", s.hex, s.name, held)  # fmt: skip
            self.end(s, "it was freed to keep detached sessions under the server's "
                     f"--max-detached-mb ({self.max_detached} bytes)")  # fmt: skip
            held -= size

    # -- what a token sees ----------------------------------------------------------------------

    def listing(self, owner: str, now: float) -> list[dict]:
        out = []
        for s in self.sessions():
            if s.owner != owner or s.ended:
                continue
            tensors, held = s.memory()
            ttl = self.detached_ttl if s.name is not None else self.grace
            out.append({
                "name": s.name,
                "session": s.id.hex()[:8],
                "state": "live" if s.detached_at is None else "detached",
                "since": since(s.attached_at if s.detached_at is None else s.detached_at),
                "tensors": tensors,
                "bytes": held,
                "kept": sorted(s.kept),
                "seconds_left": None if s.detached_at is None
                else max(0.0, ttl - (now - s.detached_at)),
            })  # fmt: skip
        return out

    def restore(self, store: Any) -> int:
        """Named sessions whose kept objects are on disk (--state-dir), detached, their kept
        objects read back only when a client asks for them."""
        from .keeping import Kept

        count = 0
        for owner, name, kept_names in store.sessions():
            s = self._make(secrets.token_bytes(16), owner, name, "(restored from --state-dir)")
            s.store = store
            for kept in kept_names:
                s.kept[kept] = Kept(None, [], durable=True, on_disk_only=True)
            rng = store.rng(owner, name)
            if rng is not None:
                s.generator.set_state(rng)
            s.detached_at = time.monotonic()
            self.by_id[s.id] = s
            self.by_name[(owner, name)] = s
            count += 1
        return count

    def drop_from_worker(self, owner: str, name: str) -> None:
        """End a named session from a session's worker thread (DROP_SESSION), once the event
        loop, which owns the registry, has done it."""
        if self.loop is None:
            return

        async def drop() -> None:
            self.drop(owner, name, "dropped by rgpu.drop_session")

        with numerics.released():
            asyncio.run_coroutine_threadsafe(drop(), self.loop).result(timeout=30)

    def drop(self, owner: str, name: str, why: str) -> None:
        s = self.find(owner, name)
        if s is None:
            return
        ws = self.connection.get(s.id)
        if ws is not None and self.close is not None:
            self.close(ws, CloseCode.DROPPED, f"session {name!r} {why}")
        if s.store is not None:
            s.store.forget(owner, name)
        log.info("session %s (%r) %s", s.hex, name, why)
        self.end(s, why)

    def find(self, owner: str, name: str) -> Session | None:
        s = self.by_name.get((owner, name))
        return None if s is None or s.ended else s
