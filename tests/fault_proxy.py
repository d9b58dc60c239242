"""A TCP proxy for tests: sits between an rgpu client and server, and misbehaves on purpose.

It can cut connections (now, or after a number of bytes in either direction: mid-batch,
mid-reply), add one-way latency, cap bandwidth, and refuse new connections for a while. It runs
its own asyncio loop on a thread, so tests drive it with plain method calls.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable


class FaultProxy:
    def __init__(
        self,
        target_port: int,
        *,
        latency_s: float = 0.0,
        bandwidth_bps: float | None = None,
        cut_budget: Callable[[], int | None] | None = None,
        target_host: str = "127.0.0.1",
    ) -> None:
        """`cut_budget` gives each new connection a number of bytes (both directions together)
        after which it is cut, or None to leave it alone."""
        self.target = (target_host, target_port)
        self.latency_s = latency_s
        self.bandwidth_bps = bandwidth_bps
        self.cut_budget = cut_budget
        self.cuts = 0
        self.connections = 0
        self.refusing = False
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="fault-proxy")
        self._thread.start()
        self._ready.wait(10)

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def start() -> None:
            self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
            self.port = self._server.sockets[0].getsockname()[1]
            self._ready.set()

        self._loop.run_until_complete(start())
        self._loop.run_forever()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.refusing:
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        self.connections += 1
        budget = [self.cut_budget() if self.cut_budget else None]
        pair = (writer, up_writer)
        self._writers.update(pair)

        def cut() -> None:
            self.cuts += 1
            for w in pair:
                w.transport.abort()  # an abrupt drop, like a dead link: no close frame, no FIN

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while True:
                    data = await src.read(65536)
                    if not data:
                        break
                    if budget[0] is not None:
                        if len(data) >= budget[0]:
                            dst.write(data[: budget[0]])  # part of a frame gets through
                            budget[0] = 0
                            cut()
                            return
                        budget[0] -= len(data)
                    if self.latency_s:
                        await asyncio.sleep(self.latency_s)
                    if self.bandwidth_bps:
                        await asyncio.sleep(len(data) / self.bandwidth_bps)
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))
        self._writers.difference_update(pair)

    def cut_all(self) -> None:
        """Drop every open connection now."""

        def go() -> None:
            for w in list(self._writers):
                w.transport.abort()
            self.cuts += 1

        self._loop.call_soon_threadsafe(go)
        time.sleep(0.05)

    def close(self) -> None:
        def go() -> None:
            self._server.close()
            for w in list(self._writers):
                w.transport.abort()
            self._loop.stop()

        self._loop.call_soon_threadsafe(go)
        self._thread.join(5)


def random_budget(rng: random.Random, low: int, high: int) -> Callable[[], int]:
    return lambda: rng.randint(low, high)
