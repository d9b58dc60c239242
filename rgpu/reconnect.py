"""Surviving a dropped connection: reconnect with backoff, resume the session, replay.

What to send again is the stream core's decision (`ClientStream.resume`); this is the I/O around
it: classify the loss, open a new connection (re-opening an SSH tunnel first, if the session has
one), swap it in under the session lock, and send.
"""

from __future__ import annotations

import logging
import threading
import time

from rgpu_protocol import CloseCode
from rgpu_protocol.client_stream import SendChunks

from .connection import split_token
from .errors import AuthError, ConnectionLost, ProtocolViolation, RgpuError, SessionLost

log = logging.getLogger("rgpu")

FIRST_DELAY_S = 0.05
MAX_DELAY_S = 2.0


class ReconnectMixin:
    """The reconnect half of `rgpu.session.Session` (a mixin over the session's state)."""

    def connection_lost(self, exc: BaseException) -> None:
        """The reader or the writer lost the connection: end the session or reconnect."""
        if self.closed or self.broken is not None:
            return
        code = getattr(getattr(exc, "rcvd", None), "code", None)
        if code == CloseCode.GOING_AWAY:
            gone = ConnectionLost(
                f"the rgpu server at {self.url} shut down; this session and its tensors are gone. "
                "Call rgpu.connect() once a server runs again.")  # fmt: skip
            ended = getattr(self.transport, "ended", None)
            if ended is None:
                self.mark_broken(gone)
            else:  # the transport may know why (a batch job ended): ask it off this thread
                threading.Thread(
                    target=lambda: self.mark_broken(ended() or gone), name="rgpu-ended", daemon=True
                ).start()
            return
        if code == CloseCode.PROTOCOL_ERROR:
            self.mark_broken(ProtocolViolation(f"the rgpu server closed the connection: {exc}"))
            return
        if code in (CloseCode.TAKEN_OVER, CloseCode.DROPPED):
            reason = getattr(getattr(exc, "rcvd", None), "reason", "") or "it ended"
            self.mark_broken(SessionLost(
                f"the named session {self.name!r} is no longer this client's: {reason}. Its "
                "tensors here are unusable; rgpu.connect(url, session=...) to open it again."))  # fmt: skip
            return
        with self._state_lock:  # not self.lock: the main thread may hold it, waiting on us
            if self.reconnecting or self.closed:
                return
            self.reconnecting = True
        log.warning("rgpu: lost the connection to %s (%s); reconnecting", self.url, exc)
        threading.Thread(target=self._reconnect, name="rgpu-reconnect", daemon=True).start()

    def _reconnect(self) -> None:
        deadline = time.monotonic() + self.config.reconnect_seconds
        delay = FIRST_DELAY_S
        self.conn.close(CloseCode.GOING_AWAY)  # not BYE: the server must keep the session for us
        while not self.closed:
            try:
                if self.transport is not None:
                    self.url = split_token(self.transport.ensure())[0]
                conn = self.open_connection(resume=True)
            except SessionLost as e:
                self.mark_broken(e)
                return
            except Exception as e:  # unreachable, refused, dropped mid-handshake: try again
                if isinstance(e, AuthError) or time.monotonic() > deadline:
                    self.mark_broken(ConnectionLost(
                        f"could not reach the rgpu server at {self.url} again within "
                        f"{self.config.reconnect_seconds:.0f} s ({e}); this session's tensors are "
                        "unreachable. Call rgpu.connect() to start a new session."))  # fmt: skip
                    return
                time.sleep(delay)
                delay = min(delay * 2, MAX_DELAY_S)
                continue
            with self.lock:
                if self.closed:
                    conn.close()
                    return
                self.writer.close(timeout=0)
                self.conn = conn
                self.writer = self.new_writer(conn)
                with self._core:
                    self.confirmed(self.stream.ack(conn.welcome.last_seq))
                    resend = self.stream.resume(conn.welcome.last_seq)
                self.reconnecting = False
                try:
                    for item in resend:
                        if type(item) is SendChunks:
                            self.send_chunks(item.seq, item.upload)
                        else:
                            self.send(item)
                except RgpuError:
                    return
                self.reconnects += 1
            log.warning("rgpu: resumed the session on %s", self.url)
            if conn.closed:  # it dropped again before we were watching
                self.connection_lost(ConnectionLost("the connection dropped during the resume"))
            return
