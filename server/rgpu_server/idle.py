"""`rgpu-server --idle-exit S`: stop the server when no client has used it for S seconds.

For a server that holds a scarce allocation (a Slurm job's GPU): a client that died without
saying goodbye, or a notebook left open overnight, must not keep it. Used means a frame arrived
from a client or a session's worker was busy; pings from a connected but idle client do not
count. Until a first client connects the limit is at most FIRST_CLIENT_S: the client that asked
for this server connects seconds after it listens, so one that has not by then is gone (killed
while its job was queued). Stopping is the ordinary graceful shutdown (clients get "going away").
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable

log = logging.getLogger("rgpu_server")

FIRST_CLIENT_S = 300.0


def activity(server) -> tuple:
    """What changes whenever a client uses the server: its sessions, the bytes their workers
    took in, and whether any worker is busy."""
    sessions = server.registry.sessions()
    return (
        frozenset(s.id for s in sessions),
        sum(s.processed for s in sessions),
        any(not s.idle() for s in sessions),
    )


def watch(
    server,
    seconds: float,
    first: float = FIRST_CLIENT_S,
    clock: Callable[[], float] = time.monotonic,
) -> threading.Thread:
    """Start a daemon thread that calls `server.stop()` after `seconds` without activity (at
    most `first` seconds before the first client)."""

    def run() -> None:
        last, since = activity(server), clock()
        limit = min(seconds, first)
        step = max(0.05, min(5.0, limit / 10))
        while True:
            time.sleep(step)
            now = activity(server)
            if now != last or now[2]:
                last, since, limit = now, clock(), seconds
            elif clock() - since >= limit:
                what = "used" if limit == seconds else "connected to"
                print(
                    f"rgpu-server: no client {what} this server for {limit:g} s (--idle-exit); "
                    "stopping",
                    file=sys.stderr,
                    flush=True,
                )
                log.info("idle for %.0f s: stopping", seconds)
                server.stop()
                return

    t = threading.Thread(target=run, name="rgpu-idle-exit", daemon=True)
    t.start()
    return t
