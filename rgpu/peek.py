"""Live facts for a live view, asked without disturbing the session: PEEK frames and probe pings.

A PEEK frame is answered by the server's event loop at once, outside the op stream: it has no
sequence number, is never queued behind the work already sent, does not report a pending failure,
and counts in none of `rgpu.stats()`'s counters (the Jupyter widget asks every few seconds, and
notebooks compare those counters exactly). `round_trip` measures the link with a websocket ping
without recording it where the session's own decisions (compression, the bulk lane) read it.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

from rgpu_protocol import Frame, parse_peek_reply, peek_frame

PEEK_REPLY = bytes((Frame.PEEK_REPLY,))  # the first byte of a PEEK_REPLY frame


class Peeks:
    """The PEEK frames a session has asked and not yet had answered."""

    def __init__(self) -> None:
        self._tokens = itertools.count(1)
        self._waiting: dict[int, list] = {}  # token -> [Event, facts]
        self._lock = threading.Lock()

    def ask(self, session: Any, timeout: float = 2.0) -> dict | None:
        """The server's live facts (INFO's device fields, and the session's `tensors` and
        `bytes`), or None: a server that does not answer PEEK, a session that is not connected,
        or no answer within `timeout`. Safe from any thread; never raises."""
        if not getattr(session.welcome, "peek", False) or session.state != "connected":
            return None
        token = next(self._tokens)
        slot: list = [threading.Event(), None]
        with self._lock:
            self._waiting[token] = slot
        try:
            session.writer.queue(peek_frame(token), 0)  # not session.send: it counts frames
            slot[0].wait(timeout)
            return slot[1]
        except Exception:
            return None
        finally:
            with self._lock:
                self._waiting.pop(token, None)

    def answered(self, frame: bytes) -> None:
        """A PEEK_REPLY arrived (the reader thread)."""
        try:
            token, facts = parse_peek_reply(frame)
        except Exception:
            return  # a malformed answer to a courtesy question: ignore it
        with self._lock:
            slot = self._waiting.get(token)
        if slot is not None:
            slot[1] = facts
            slot[0].set()


def round_trip(session: Any, timeout: float = 2.0) -> float | None:
    """The link's round trip in seconds, measured now with a websocket ping, or None (not
    connected, or no pong within `timeout`). Unlike `Session.ping`, it leaves `link.rtt_s` alone."""
    if session.state != "connected":
        return None
    try:
        t0 = time.perf_counter()
        if session.conn.ws.ping().wait(timeout):
            return time.perf_counter() - t0
    except Exception:
        pass
    return None
