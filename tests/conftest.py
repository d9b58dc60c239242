"""Test fixtures: a real `rgpu-server --device cpu` subprocess on a free loopback port.

Every end-to-end test talks to it over a real websocket; nothing is mocked. The server runs for the
whole test session; tests that need a server of their own (flags, restarts, shutdown) get one from
`start_server`. Tests run as users run: the client predicts and the server runs, with no checking
mode (RGPU_CHECK_META) and nothing repaired.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rgpu_test_servers import ServerProcess

import rgpu

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def server():
    srv = ServerProcess()
    yield srv
    rgpu.disconnect()
    srv.stop()


@pytest.fixture
def start_server():
    """`start_server(*flags, env=..., port=...)`: a server of the test's own (a ServerProcess).

    At teardown the client disconnects (its session may be on one of them, directly or through
    a proxy) and every one is stopped."""
    started: list[ServerProcess] = []

    def start(*flags: str, **kwargs) -> ServerProcess:
        srv = ServerProcess(*flags, **kwargs)
        started.append(srv)
        return srv

    yield start
    if started:
        rgpu.disconnect()
    for srv in started:
        srv.stop()


@pytest.fixture
def session(server):
    """The current rgpu session, connected to the shared test server."""
    import rgpu.current

    s = rgpu.current.get()
    if s is None or s.closed or s.url != server.url or s.broken is not None:
        s = rgpu.connect(server.url)
    return s


@pytest.fixture
def dev(session):
    """The device string, with the session guaranteed connected and error-free."""
    yield "rgpu"
    # a test that leaves a pending remote error must not leak it into the next test
    try:
        torch.rgpu.synchronize()
    except rgpu.RemoteError:
        pass


class StatsDelta:
    def __init__(self) -> None:
        self.start = rgpu.stats()

    def __call__(self) -> dict:
        now = rgpu.stats()
        return {k: now[k] - self.start[k] for k in now}


@pytest.fixture
def counted(dev):
    """Call it to get the stats accumulated since the test started."""
    torch.rgpu.synchronize()
    return StatsDelta()


@pytest.fixture
def proxied(server):
    """FaultProxy(**kwargs) in front of the shared server (cuts, latency, a bandwidth cap)."""
    from fault_proxy import FaultProxy
    from rgpu_test_servers import port_of

    proxies = []

    def make(**kwargs) -> FaultProxy:
        p = FaultProxy(port_of(server.url), **kwargs)
        proxies.append(p)
        return p

    yield make
    rgpu.disconnect()
    for p in proxies:
        p.close()


@pytest.fixture(scope="module")
def one_thread():
    """A server computing on one thread, and the client's torch on one thread meanwhile: rgpu's
    results compare with local CPU torch bit for bit (the replayed-steps tests)."""
    srv = ServerProcess(env={"OMP_NUM_THREADS": "1"})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield srv
    torch.set_num_threads(threads)
    rgpu.disconnect()
    srv.stop()


@pytest.fixture
def replay_on():
    """Replayed steps on (they are off by default), and the settings a test changed back."""
    rgpu.settings.replay = True
    yield
    rgpu.settings.replay = None  # each session's RGPU_REPLAY again
    rgpu.settings.op_sites = False
