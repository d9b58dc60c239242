"""A TCP link emulator: put it between an rgpu client and server to see how a workload behaves
on a real network (round-trip latency, a bandwidth cap), or to cut connections on purpose.

    python -m rgpu.netem --target 127.0.0.1:9720 --listen 9721 --rtt-ms 50 --mbit 100
    RGPU_SERVER=ws://127.0.0.1:9721 python train.py

Each direction is a delay line: bytes read at time t are written at t + rtt/2 (in order, without
holding up the bytes behind them), no faster than the bandwidth cap. It runs its own asyncio loop
on a thread, so benchmarks and tests drive it with plain calls. Run it as its own process
(`python -m rgpu.netem`) when the client is busy: in the client's process its thread competes for
the GIL with the thread issuing ops, and a latency-delayed delivery then waits for the GIL too.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sys
import threading
import time
from collections.abc import Callable


class LinkEmulator:
    def __init__(
        self,
        target_port: int,
        *,
        rtt_s: float = 0.0,
        bandwidth_bps: float | None = None,
        cut_budget: Callable[[], int | None] | None = None,
        target_host: str = "127.0.0.1",
        listen_port: int = 0,
    ) -> None:
        """`bandwidth_bps` is in bytes per second, per direction. `cut_budget` gives each new
        connection a number of bytes (both directions together) after which it is cut abruptly,
        or None to leave it alone."""
        self.target = (target_host, target_port)
        self.rtt_s = rtt_s
        self.bandwidth_bps = bandwidth_bps
        self.cut_budget = cut_budget
        self.cuts = 0
        self.connections = 0
        self.refusing = False
        self._listen_port = listen_port
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="rgpu-netem")
        self._thread.start()
        self._ready.wait(10)

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def start() -> None:
            self._server = await asyncio.start_server(self._accept, "127.0.0.1", self._listen_port)
            self.port = self._server.sockets[0].getsockname()[1]
            self._ready.set()

        self._loop.run_until_complete(start())
        self._loop.run_forever()
        # closed: let the pipes of aborted connections finish here, not as garbage on a dead loop
        pending = asyncio.all_tasks(self._loop)
        for task in pending:
            task.cancel()
        self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self._loop.close()

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
                w.transport.abort()  # like a dead link: no close frame, no FIN

        await asyncio.gather(
            self._pipe(reader, up_writer, budget, cut),
            self._pipe(up_reader, writer, budget, cut),
            return_exceptions=True,
        )
        self._writers.difference_update(pair)

    async def _pipe(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, budget: list, cut: Callable
    ) -> None:
        line: collections.deque[tuple[float, bytes]] = collections.deque()
        more = asyncio.Event()
        room = asyncio.Event()  # the bottleneck's queue has space again
        queued = [0]
        done = False

        async def deliver() -> None:
            sent_until = time.monotonic()  # when the cap lets the next byte go
            while True:
                while not line:
                    if done:
                        return
                    more.clear()
                    await more.wait()
                due, data = line.popleft()
                queued[0] -= len(data)
                room.set()
                now = time.monotonic()
                if self.bandwidth_bps:
                    sent_until = max(sent_until, now) + len(data) / self.bandwidth_bps
                    due = max(due, sent_until)
                if due > now:
                    await asyncio.sleep(due - now)
                dst.write(data)
                await dst.drain()

        writer = asyncio.ensure_future(deliver())
        cutting = False
        try:
            while True:
                data = await src.read(65536)
                if not data:
                    break
                if budget[0] is not None:
                    if len(data) >= budget[0]:
                        # part of a frame gets through, after the bytes before it (written
                        # straight away it could overtake them: a reordered stream, which TCP
                        # never delivers), and then the link dies
                        line.append((time.monotonic() + self.rtt_s / 2, data[: budget[0]]))
                        queued[0] += budget[0]
                        budget[0] = 0
                        cutting = True
                        return
                    budget[0] -= len(data)
                line.append((time.monotonic() + self.rtt_s / 2, data))
                queued[0] += len(data)
                more.set()
                # a capped link holds about one bandwidth-delay product in flight, plus a
                # bottleneck queue; the sender feels back-pressure beyond that, as over TCP
                while self.bandwidth_bps and queued[0] > self._queue_limit():
                    room.clear()
                    await room.wait()
        except (ConnectionError, OSError):
            pass
        finally:
            done = True
            more.set()
            try:
                await writer
            except (ConnectionError, OSError):
                pass
            if cutting:
                cut()
            else:
                dst.close()

    def _queue_limit(self) -> float:
        return max(self.bandwidth_bps * (self.rtt_s / 2 + 0.05), 65536)

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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m rgpu.netem", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="127.0.0.1:9720", help="the rgpu server, host:port")
    p.add_argument("--listen", type=int, default=9721, help="local port to listen on")
    p.add_argument("--rtt-ms", type=float, default=50.0, help="round-trip latency to add")
    p.add_argument("--mbit", type=float, default=None, help="bandwidth cap per direction, Mbit/s")
    p.add_argument(
        "--control-stdin",
        action="store_true",
        help="read a new RTT in ms from each line of stdin; exit at end of input",
    )
    args = p.parse_args(argv)
    host, port = args.target.rsplit(":", 1)
    link = LinkEmulator(
        int(port),
        target_host=host,
        listen_port=args.listen,
        rtt_s=args.rtt_ms / 1000,
        bandwidth_bps=args.mbit * 1e6 / 8 if args.mbit else None,
    )
    print(
        f"rgpu.netem: ws://127.0.0.1:{link.port} -> {args.target}, RTT {args.rtt_ms} ms", flush=True
    )
    try:
        if args.control_stdin:  # a benchmark changes the latency of live connections this way
            for line in sys.stdin:
                if line.strip():
                    link.rtt_s = float(line) / 1000
                    print(f"rgpu.netem: RTT {float(line)} ms", flush=True)
        else:
            threading.Event().wait()
    except KeyboardInterrupt:
        pass
    link.close()


if __name__ == "__main__":
    main()
