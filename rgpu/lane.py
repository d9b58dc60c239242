"""The client end of the bulk lane (see rgpu_protocol/lane.py): large tensors as raw bytes.

One plain socket (TLS for wss://), opened with a websocket upgrade that websockets' sans-I/O
client builds and checks, then read by one thread that puts DATA records straight into the
destination tensor's memory (`recv_into`) and sends nothing itself. Uploads are written by the
calling thread and confirmed by an ACK.
"""

from __future__ import annotations

import socket
import threading
import urllib.parse
from collections.abc import Callable

from websockets.client import ClientProtocol
from websockets.uri import parse_uri

from rgpu_protocol import ProtocolError
from rgpu_protocol.lane import (
    FROM_SERVER,
    HEADER_SIZE,
    KEY_HEADER,
    SESSION_HEADER,
    LaneRecord,
    lane_header,
    parse_lane_header,
)

from ._version import __version__

MAX_RESPONSE_HEAD = 64 << 10
_DISCARD = 1 << 20
SEND_PIECE = 16 << 20  # an upload is written this much at a time (progress, Ctrl-C)


class LaneError(Exception):
    """The lane failed or closed; the transfer goes over the websocket instead."""


class Receipt:
    """What a caller waits for on the lane, settled by the reader thread: a download's bytes
    arriving in `view`, or the ACK of an upload of `len(view)` bytes."""

    def __init__(self, view: memoryview) -> None:
        self.view = view
        self.got = 0
        self.done = threading.Event()
        self.ok = False


class Lane:
    def __init__(
        self,
        url: str,
        *,
        path: str,
        token: str | None,
        session: bytes,
        key: bytes,
        ssl_context=None,
        timeout: float = 10.0,
    ) -> None:
        parts = urllib.parse.urlsplit(url)
        host, port = parts.hostname or "127.0.0.1", parts.port or (443 if ssl_context else 80)
        sock = socket.create_connection((host, port), timeout=timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if ssl_context is not None:
                sock = ssl_context.wrap_socket(sock, server_hostname=host)
            rest = self._upgrade(sock, url, path, token, session, key)
            header = self._recv_exact(sock, HEADER_SIZE, rest)
            kind, _, _ = parse_lane_header(header, FROM_SERVER, 0)
            if kind != LaneRecord.READY:
                raise ProtocolError(f"the lane began with record {kind.name}, not READY")
            sock.settimeout(None)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self.closed = False
        self.error: BaseException | None = None
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._acks: dict[int, Receipt] = {}
        self._receipts: dict[int, Receipt] = {}
        self._reader = threading.Thread(target=self._read_loop, name="rgpu-lane", daemon=True)
        self._reader.start()

    # -- opening -------------------------------------------------------------------------------

    @staticmethod
    def _upgrade(
        sock: socket.socket, url: str, path: str, token: str | None, session: bytes, key: bytes
    ) -> bytes:
        """The HTTP upgrade; returns any bytes that arrived after the response head."""
        parts = urllib.parse.urlsplit(url)
        lane_url = urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", ""))
        protocol = ClientProtocol(parse_uri(lane_url))
        request = protocol.connect()
        request.headers["User-Agent"] = f"rgpu/{__version__}"
        request.headers[SESSION_HEADER] = session.hex()
        request.headers[KEY_HEADER] = key.hex()
        if token:
            request.headers["Authorization"] = f"Bearer {token}"
        protocol.send_request(request)
        sock.sendall(b"".join(protocol.data_to_send()))
        buf = b""
        while b"\r\n\r\n" not in buf:
            got = sock.recv(65536)
            if not got:
                raise LaneError("the server closed the lane during its upgrade")
            buf += got
            if len(buf) > MAX_RESPONSE_HEAD:
                raise LaneError("the lane's upgrade response is too long")
        end = buf.index(b"\r\n\r\n") + 4
        status = buf.split(b"\r\n", 1)[0].decode("latin-1")
        if " 101 " not in status + " ":
            raise LaneError(f"the server refused the lane: {status}")
        protocol.receive_data(buf[:end])
        protocol.events_received()
        if protocol.handshake_exc is not None:
            raise LaneError(f"the lane's upgrade failed: {protocol.handshake_exc}")
        return buf[end:]

    @staticmethod
    def _recv_exact(sock: socket.socket, n: int, prefix: bytes = b"") -> bytes:
        buf = bytearray(prefix[:n])
        if len(prefix) > n:
            raise ProtocolError("the server sent lane bytes before it was asked")
        while len(buf) < n:
            got = sock.recv(n - len(buf))
            if not got:
                raise LaneError("the lane closed")
            buf += got
        return bytes(buf)

    # -- transfers -----------------------------------------------------------------------------

    def put(
        self,
        ticket: int,
        data: memoryview,
        progress: Callable[[int], None] | None = None,
        timeout: float = 60.0,
    ) -> None:
        """Stage `data` on the server as upload `ticket`; returns once the server has it all."""
        acked = Receipt(data)
        with self._lock:
            self._check()
            self._acks[ticket] = acked
        try:
            with self._send_lock:
                self._check()
                try:
                    self.sock.sendall(lane_header(LaneRecord.PUT, ticket, len(data)))
                    for off in range(0, len(data), SEND_PIECE):
                        self.sock.sendall(data[off : off + SEND_PIECE])
                        if progress is not None:
                            progress(min(off + SEND_PIECE, len(data)))
                except BaseException as e:  # an interrupted record leaves the stream torn
                    self._fail(e)
                    if isinstance(e, OSError):
                        raise LaneError(f"the lane failed during an upload: {e}") from None
                    raise
            while not acked.done.wait(0.1):
                timeout -= 0.1
                if timeout <= 0:
                    self._fail(LaneError("the server did not confirm a lane upload in time"))
            if not acked.ok:
                self._check()
                raise LaneError("the lane upload was not confirmed")
        finally:
            with self._lock:
                self._acks.pop(ticket, None)

    def expect(self, ticket: int, view: memoryview) -> Receipt:
        """Register where download `ticket`'s bytes go; call before sending the DOWNLOAD."""
        receipt = Receipt(view)
        with self._lock:
            self._check()
            self._receipts[ticket] = receipt
        return receipt

    def forget(self, ticket: int) -> None:
        with self._lock:
            self._receipts.pop(ticket, None)

    def wait(
        self, receipt: Receipt, ticket: int, progress: Callable[[int], None] | None = None
    ) -> bool:
        """True once the download's bytes are all in; False if the lane closed first."""
        try:
            while not receipt.done.wait(0.1):
                if progress is not None:
                    progress(receipt.got)
            return receipt.ok
        finally:
            self.forget(ticket)

    def _check(self) -> None:
        if self.closed:
            raise LaneError(f"the lane is closed ({self.error})")

    # -- the reader thread ---------------------------------------------------------------------

    def _read_loop(self) -> None:
        sock = self.sock
        header = bytearray(HEADER_SIZE)
        scratch = bytearray(_DISCARD)
        try:
            while True:
                self._fill(sock, memoryview(header))
                kind, ticket, nbytes = parse_lane_header(header, FROM_SERVER, 1 << 62)
                if kind == LaneRecord.ACK:
                    with self._lock:
                        acked = self._acks.get(ticket)
                    if acked is not None and len(acked.view) == nbytes:
                        acked.ok = True
                        acked.done.set()
                elif kind == LaneRecord.DATA:
                    with self._lock:
                        receipt = self._receipts.get(ticket)
                    if receipt is None or len(receipt.view) != nbytes:
                        while nbytes:  # nobody waits for it (any more): read it away
                            n = sock.recv_into(scratch, min(nbytes, len(scratch)))
                            if not n:
                                raise LaneError("the lane closed")
                            nbytes -= n
                        continue
                    self._fill(sock, receipt.view, receipt)
                    receipt.ok = True
                    receipt.done.set()
                else:
                    raise ProtocolError(f"unexpected lane record {kind.name}")
        except BaseException as e:
            self._fail(e)

    @staticmethod
    def _fill(sock: socket.socket, view: memoryview, receipt: Receipt | None = None) -> None:
        got, n = 0, len(view)
        while got < n:
            k = sock.recv_into(view[got:])
            if not k:
                raise LaneError("the lane closed")
            got += k
            if receipt is not None:
                receipt.got = got

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self.error = exc
            receipts = list(self._receipts.values())
            acks = list(self._acks.values())
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        for r in receipts:
            r.done.set()
        for a in acks:
            a.done.set()

    def close(self) -> None:
        self._fail(LaneError("closed"))
        if threading.current_thread() is not self._reader:
            self._reader.join(timeout=5)
