"""The server's outbox: a session's replies reach its websocket in order, whole, without the worker
waiting on each one, and a client that stops reading still holds the worker back.

A real websockets server and client on loopback; the worker is a plain thread, as a session's."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
from rgpu_server.outbox import Outbox
from websockets.asyncio.server import serve
from websockets.client import ClientProtocol
from websockets.sync.client import connect
from websockets.uri import parse_uri


class Server:
    """A websockets server on a loop thread; each connection gets an Outbox, and `ready` hands
    it to the test, which plays the session's worker thread."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.outboxes: list[Outbox] = []
        self.ready = threading.Event()
        self.loop = asyncio.new_event_loop()
        self._stop: asyncio.Future | None = None
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self._thread.start()
        assert started.wait(10)

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._main(started))

    async def _main(self, started: threading.Event) -> None:
        async def handler(ws) -> None:
            self.outboxes.append(Outbox(ws, asyncio.get_running_loop(), limit=self.limit))
            self.ready.set()
            await ws.wait_closed()

        self._stop = self.loop.create_future()
        # small buffers, so a client that stops reading pauses the server's transport soon
        async with serve(handler, "127.0.0.1", 0, write_limit=16 << 10, max_size=None) as srv:
            self.port = srv.sockets[0].getsockname()[1]
            started.set()
            await self._stop

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self._stop.set_result, None)
        self._thread.join(10)


@pytest.fixture
def server():
    srv = Server(limit=256 << 10)
    yield srv
    srv.close()


def _frames(n: int, size: int) -> list:
    """n distinct frames; every third one given as a list of parts (one fragmented message)."""
    out = []
    for i in range(n):
        body = i.to_bytes(4, "big") * (size // 4)
        out.append([body[: size // 2], body[size // 2 :]] if i % 3 == 2 else body)
    return out


def _whole(frame) -> bytes:
    return b"".join(frame) if isinstance(frame, list) else frame


def test_frames_arrive_in_order_and_whole(server):
    with connect(f"ws://127.0.0.1:{server.port}", max_size=None) as client:
        assert server.ready.wait(10)
        outbox = server.outboxes[0]
        sent = _frames(300, 100)
        worker = threading.Thread(target=lambda: [outbox.send(sent[i : i + 3])
                                                  for i in range(0, len(sent), 3)])  # fmt: skip
        worker.start()
        got = [client.recv(timeout=10) for _ in sent]
        worker.join(10)
    assert got == [_whole(f) for f in sent]


class RawClient:
    """A websocket client that reads its socket only when told: websockets' sans-I/O protocol over
    a plain socket (a library client reads on a thread of its own, whatever the caller does)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        self.protocol = ClientProtocol(parse_uri(f"ws://127.0.0.1:{port}"), max_size=None)
        self.protocol.send_request(self.protocol.connect())
        self._flush()
        while not self.protocol.events_received() and self.protocol.handshake_exc is None:
            self.protocol.receive_data(self.sock.recv(1 << 16))  # the handshake's response
        self.messages: list[bytes] = []
        self._parts: list[bytes] = []

    def _flush(self) -> None:
        for data in self.protocol.data_to_send():
            self.sock.sendall(data)

    def read(self, count: int, timeout: float) -> list[bytes]:
        self.sock.settimeout(timeout)
        while len(self.messages) < count:
            self.protocol.receive_data(self.sock.recv(1 << 20))
            for frame in self.protocol.events_received():
                self._parts.append(frame.data)
                if frame.fin:
                    self.messages.append(b"".join(self._parts))
                    self._parts = []
            self._flush()
        return self.messages


def test_a_client_that_stops_reading_holds_the_worker_back(server):
    client = RawClient(server.port)
    try:
        assert server.ready.wait(10)
        outbox = server.outboxes[0]
        # 51 MB, more than loopback's socket buffers hold; the outbox lets 256 KiB wait unwritten
        sent = _frames(200, 256 << 10)
        progress = []

        def work() -> None:
            for f in sent:
                outbox.send([f])
                progress.append(1)

        worker = threading.Thread(target=work, daemon=True)
        worker.start()
        time.sleep(1.0)  # the client reads nothing meanwhile
        held = len(progress)
        assert held < len(sent) // 2, f"the worker ran on: {held} of {len(sent)} frames queued"
        got = client.read(len(sent), timeout=20)  # reading again lets it finish
        worker.join(20)
        assert not worker.is_alive()
    finally:
        client.sock.close()
    assert got == [_whole(f) for f in sent]


def test_frames_for_a_closed_connection_are_dropped_without_blocking(server):
    with connect(f"ws://127.0.0.1:{server.port}", max_size=None):
        assert server.ready.wait(10)
        outbox = server.outboxes[0]
    time.sleep(0.3)
    worker = threading.Thread(  # 6.4 MB, past the limit
        target=lambda: [outbox.send([f]) for f in _frames(100, 64 << 10)], daemon=True
    )
    worker.start()
    worker.join(15)
    assert not worker.is_alive(), "the worker waits on frames that can never be written"
    deadline = time.monotonic() + 5
    while outbox._queued and time.monotonic() < deadline:
        time.sleep(0.01)
    assert outbox._queued == 0  # every frame was dropped, none is still counted as queued


def test_flushed_waits_for_what_is_queued():
    """A shutdown closes the connection only after the replies the worker sent."""
    server = Server(limit=64 << 20)
    client = RawClient(server.port)
    try:
        assert server.ready.wait(10)
        outbox = server.outboxes[0]
        sent = _frames(40, 256 << 10)  # 10 MB: past the socket buffers, under this outbox's limit
        for f in sent:
            outbox.send([f])

        def flushed(timeout: float) -> float:
            start = time.monotonic()
            asyncio.run_coroutine_threadsafe(outbox.flushed(timeout), server.loop).result(30)
            return time.monotonic() - start

        assert flushed(0.5) >= 0.5  # the client reads nothing: frames are still queued
        reader = threading.Thread(target=client.read, args=(len(sent), 20))
        reader.start()
        assert flushed(20) < 15  # the client reads: every frame gets written
        reader.join(20)
    finally:
        client.sock.close()
        server.close()
    assert client.messages == [_whole(f) for f in sent]
