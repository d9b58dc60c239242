"""rgpu.netem's link emulator itself: a cut link delivers a prefix of the stream, never bytes out
of order (TCP never reorders; a proxy that did made a resumed session read a garbled frame)."""

from __future__ import annotations

import random
import socket
import threading

from rgpu.netem import LinkEmulator


class Sink:
    """A TCP server that keeps every byte its one client sends."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.received = bytearray()
        self.done = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        try:
            while data := conn.recv(1 << 16):
                self.received += data
        except OSError:  # reset by the cut
            pass
        finally:
            conn.close()
            self.done.set()


def send_through_cut(budget: int, seed: int) -> tuple[bytes, bytes]:
    sink = Sink()
    link = LinkEmulator(sink.port, cut_budget=lambda: budget)
    sent = random.Random(seed).randbytes(4 << 20)
    try:
        with socket.create_connection(("127.0.0.1", link.port)) as s:
            try:
                for off in range(0, len(sent), 1500):  # many small writes, as a busy client
                    s.sendall(sent[off : off + 1500])
            except OSError:  # the cut reached us
                pass
        assert sink.done.wait(10), "the link was never cut"
    finally:
        link.close()
        sink.sock.close()
    return sent, bytes(sink.received)


def test_a_cut_link_delivers_a_prefix_of_the_stream_in_order():
    for seed, budget in enumerate([1, 70_000, 300_000, 1_000_001, 2_500_000]):
        sent, received = send_through_cut(budget, seed)
        assert len(received) <= budget
        assert received == sent[: len(received)], (
            f"bytes reordered or lost before the cut at {budget}"
        )
        assert len(received) > budget // 2, "the link was cut long before its budget"
