"""What the client knows about its link to the server, and the choices that follow from it.

The round trip is measured at every connect and ping, the throughput by every large download;
from them: whether batches go out compressed, and whether a transfer takes the bulk lane (a
second connection carrying raw bytes, rgpu.lane) or the websocket.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from rgpu_protocol import Frame, LaneOffer, compress_batch

from .config import Config
from .connection import Connection, ssl_context
from .lane import Lane

log = logging.getLogger("rgpu")

COMPRESS_MIN_BYTES = 256  # smaller batches gain too little to be worth compressing
SLOW_LINK_RTT_S = 0.010  # a link with a longer round trip is a WAN: compress batches...
SLOW_LINK_BPS = 50e6  # ...and so is one measured below 400 Mbit/s
LINK_PROBE_BYTES = 1 << 20  # downloads this large measure the link's throughput
LANE_BYTES_PER_RTT = 1e9  # a lane transfer waits one extra round trip: worth it past 1 GB/s x RTT
LANE_RETRY_S = 30.0  # after a lane fails to open, transfers use the websocket this long
LANE_HASH_BELOW_BPS = 500e6  # lane uploads are hashed for dedup when the lane is slower than this


def measure_rtt(conn: Connection) -> float:
    """The link's round trip: the lower of the handshake's and one websocket ping's (the
    handshake alone also counts the server setting up the session)."""
    rtt = conn.handshake_rtt_s
    t0 = time.perf_counter()
    try:
        if conn.ws.ping().wait(min(5.0, 10 * rtt + 0.1)):
            rtt = min(rtt, time.perf_counter() - t0)
    except Exception:  # the link dropped already: the reconnect logic takes it from here
        pass
    return rtt


class Link:
    def __init__(self, config: Config) -> None:
        self.compress_mode = config.compress
        self.lane_enabled = config.lane
        self.lane_min_bytes = config.lane_min_bytes
        self.proxy = config.proxy
        self.ca_bundle = config.ca_bundle
        self.rtt_s = 0.0  # measured: the handshake, then every ping
        self.bps: float | None = None  # measured: the last download of a megabyte or more
        self.server_zlib = False  # the server understands BATCH_Z
        self.compressed_frames = 0
        self.compression_saved = 0  # bytes the compressed batches did not put on the wire
        self.lane_bps = float("inf")  # measured by each lane upload
        self.lane_transfers = 0
        self._lane: Lane | None = None
        self._lane_lock = threading.Lock()
        self._lane_retry_at = 0.0

    def connected(self, conn: Connection) -> None:
        self.rtt_s = measure_rtt(conn)
        self.server_zlib = "zlib" in conn.welcome.compress

    # -- compression ------------------------------------------------------------------------------

    @property
    def compressing(self) -> bool:
        """Whether batches go out compressed now: when asked (RGPU_COMPRESS=1) or, by default,
        when the link is measured slow (a long round trip or a low throughput); the op stream
        shrinks several-fold, so that is where compressing pays."""
        if not self.server_zlib or self.compress_mode == "off":
            return False
        if self.compress_mode == "on":
            return True
        bps = self.bps
        return self.rtt_s >= SLOW_LINK_RTT_S or (bps is not None and bps < SLOW_LINK_BPS)

    def wire_form(self, frame: bytes | list) -> bytes | list:
        """The form a compressible frame goes out in (on the writer thread): a batch compressed
        when that pays."""
        if (
            type(frame) is not bytes
            or len(frame) < COMPRESS_MIN_BYTES
            or frame[0] != Frame.BATCH
            or not self.compressing
        ):
            return frame
        packed = compress_batch(frame)
        if packed is None:
            return frame
        self.compressed_frames += 1
        self.compression_saved += len(frame) - len(packed)
        return packed

    def measured_download(self, nbytes: int, first_at: float, last_at: float, first: int) -> None:
        """A download's DATA arrived from `first_at` to `last_at` (the first one `first` bytes):
        the pace of the data itself, not the wait for the ops before it."""
        if nbytes >= LINK_PROBE_BYTES and last_at > first_at:
            self.bps = (nbytes - first) / (last_at - first_at)

    # -- the bulk lane ----------------------------------------------------------------------------

    def hash_lane_uploads(self) -> bool:
        """Hashing (about 1.2 GB/s) pays only where sending is slower than that."""
        return self.lane_bps < LANE_HASH_BELOW_BPS

    def lane_for(
        self, nbytes: int, url: str, token: str | None, session: bytes, offer: LaneOffer | None,
        timeout: float,
    ) -> Lane | None:  # fmt: skip
        """The open lane, opening it if need be, when a transfer of `nbytes` should use it."""
        if (
            not self.lane_enabled
            or nbytes < self.lane_min_bytes
            or nbytes < self.rtt_s * LANE_BYTES_PER_RTT
            or offer is None
            or self.proxy  # the websocket library speaks to proxies; we don't
        ):
            return None
        with self._lane_lock:
            lane = self._lane
            if lane is not None and not lane.closed:
                return lane
            if time.monotonic() < self._lane_retry_at:
                return None
            try:
                lane = Lane(
                    url,
                    path=offer.path,
                    token=token,
                    session=session,
                    key=offer.key,
                    ssl_context=ssl_context(url, self.ca_bundle),
                    timeout=timeout,
                )
            except Exception as e:  # refused, unreachable, TLS: the websocket carries the bytes
                log.info("rgpu: no bulk lane to %s (%s); large transfers use the websocket", url, e)
                self._lane_retry_at = time.monotonic() + LANE_RETRY_S
                self._lane = None
                return None
            self._lane = lane
            return lane

    def lane_failed(self, lane: Lane, exc: BaseException) -> None:
        log.info("rgpu: the bulk lane failed (%s); the transfer goes over the websocket", exc)
        lane.close()

    def close(self) -> None:
        if self._lane is not None:
            self._lane.close()

    @property
    def lane(self) -> Any:
        return self._lane
