"""Surviving a dropped link: reconnect, resume by session id, replay, exactly-once application.

A fault-injecting TCP proxy sits between the client and a real server and cuts connections at
random byte counts, so cuts land mid-batch, mid-upload and mid-reply.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from fault_proxy import FaultProxy
from loops import mlp_losses
from rgpu_test_servers import port_of
from waits import DuringNextWait

import rgpu


def test_training_through_fifty_random_cuts_is_bit_identical(server, proxied):
    rgpu.connect(server.url)
    clean = mlp_losses(30)
    rng = random.Random(1234)
    proxy = proxied(cut_budget=lambda: rng.randint(200, 700_000))
    session = rgpu.connect(proxy.url)
    steps = 30
    cut_run = mlp_losses(steps)
    while session.reconnects < 50:  # keep going until at least 50 random cuts were survived
        more = mlp_losses(steps)
        assert more == clean[:steps]
    assert cut_run == clean, "losses after dropped connections differ from the uninterrupted run"
    assert session.reconnects >= 50
    print(f"\n{proxy.cuts} cuts, {session.reconnects} resumes, {proxy.connections} connections")


def test_cuts_at_chosen_points_mid_batch_and_mid_reply(server, proxied, monkeypatch):
    # the websocket itself is cut mid-upload and mid-download here, so the 8 MB transfers must
    # ride on it (test_lane.py cuts the lane instead)
    monkeypatch.setenv("RGPU_LANE", "0")
    proxy = proxied()
    session = rgpu.connect(proxy.url)
    x = torch.arange(1000.0, device="rgpu")
    torch.rgpu.synchronize()
    for _ in range(300):  # queued, partly flushed
        x = x + 1
    proxy.cut_all()  # mid-stream
    assert x.sum().item() == sum(range(1000)) + 300 * 1000
    assert session.reconnects == 1
    big = torch.randn(2_000_000)  # 8 MB
    plan = iter([3_000_000])  # the next connection is cut 3 MB in: mid-upload
    proxy.cut_budget = lambda: next(plan, None)
    proxy.cut_all()
    r = big.to("rgpu")
    assert torch.equal(r.cpu(), big)
    assert session.reconnects == 3
    plan = iter([4_000_000])  # cut mid-reply: the 8 MB download is half received
    proxy.cut_all()
    assert torch.equal(r.cpu(), big)
    assert session.reconnects == 5


def test_waits_in_flight_survive_a_cut(server, proxied):
    proxy = proxied()
    session = rgpu.connect(proxy.url)
    host = torch.randn(400, 400) / 20
    a, ref = host.to("rgpu"), host
    for _ in range(30):
        a, ref = (a @ a).tanh(), (ref @ ref).tanh()
    torch.rgpu.synchronize()
    a = a.sum()
    # the link now takes 0.3 s each way, so the reply cannot arrive before the cut, which comes
    # 0.1 s into the wait: the cut lands inside the wait, every time
    proxy.rtt_s = 0.6
    cut = DuringNextWait(session, proxy.cut_all, after=0.1)
    value = a.item()
    cut.join()
    proxy.rtt_s = 0.0
    assert value == pytest.approx(ref.sum().item(), rel=1e-4, abs=1e-4)
    assert (a * 0).item() == 0.0  # the session goes on after the cut
    assert session.reconnects == 1


def test_a_restarted_server_gives_session_lost_and_connect_works_again(start_server):
    srv = start_server()
    port = port_of(srv.url)
    rgpu.connect(srv.url)
    x = torch.ones(3, device="rgpu")
    torch.rgpu.synchronize()
    srv.proc.kill()  # a crash: no goodbye, the client tries to resume
    srv.proc.wait()
    srv = _restart_on(port, start_server)
    with pytest.raises(rgpu.SessionLost, match="tensor of the session is gone"):
        (x + 1).sum().item()
    with pytest.raises(rgpu.SessionLost):
        torch.ones(2, device="rgpu").sum().item()
    rgpu.connect(srv.url)
    assert torch.ones(2, device="rgpu").sum().item() == 2.0


def _restart_on(port: int, start_server):
    """A server on the port a killed one listened on (once the OS lets it go)."""
    deadline = time.time() + 20
    while True:
        try:
            return start_server(port=port)
        except RuntimeError:
            if time.time() > deadline:
                raise
            time.sleep(0.2)


def test_a_session_outlives_its_grace_period_only_so_long(proxied, start_server):
    srv = start_server("--session-grace", "1")
    proxy = FaultProxy(port_of(srv.url))
    rgpu.connect(proxy.url)
    x = torch.ones(3, device="rgpu")
    torch.rgpu.synchronize()
    proxy.refusing = True
    proxy.cut_all()
    time.sleep(3)  # longer than the grace: the server ends the session
    proxy.refusing = False
    with pytest.raises(rgpu.SessionLost, match="expired|no longer has"):
        x.sum().item()
    deadline = time.time() + 10
    while "expired" not in srv.log() and time.time() < deadline:
        time.sleep(0.05)
    assert "expired after 1 s without its client; its tensors are gone" in srv.log()
    proxy.close()


def test_sigterm_finishes_in_flight_work_then_says_going_away(start_server):
    srv = start_server()
    rgpu.connect(srv.url)  # a session of the test's own, to watch the server work
    before = rgpu.session_info()["server"]["tensors"]
    code = f"""
        import sys, torch, rgpu
        rgpu.connect({srv.url!r})
        a = torch.randn(1200, 1200, device="rgpu")
        for _ in range(60):  # seconds of work, in flight when the SIGTERM lands
            a = (a @ a).tanh()
        print("queued", flush=True)
        print(a.sum().item(), flush=True)   # completes: in-flight work finishes
        try:
            torch.ones(2, device="rgpu").sum().item()
        except rgpu.ConnectionLost as e:
            print("lost:", e, flush=True)
    """
    # no flush by time or count: the ops and the DOWNLOAD of .item() go out in one frame
    env = {**os.environ, "RGPU_QUIET_US": "600000000", "RGPU_FLUSH_OPS": "100000"}
    client = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert client.stdout.readline().strip() == "queued"
    # once the client's session has made `a`, its one frame, DOWNLOAD included, has arrived
    deadline = time.time() + 60
    while rgpu.session_info()["server"]["tensors"] < before + 1:
        assert time.time() < deadline, "the client's work never reached the server"
        time.sleep(0.02)
    srv.proc.send_signal(signal.SIGTERM)
    out, err = client.communicate(timeout=120)
    lines = out.splitlines()
    float(lines[0])  # the work sent before the SIGTERM completed and its result arrived
    assert lines[1].startswith("lost: the rgpu server at ") and "shut down" in lines[1], (
        out,
        err,
    )
    assert srv.proc.wait(timeout=60) == 0
    assert "rgpu-server stopped" in srv.log()


def test_replay_buffer_is_bounded_by_flow_control(server, proxied):
    env = {"RGPU_REPLAY_BYTES": "20000", "RGPU_SERVER": server.url}
    code = """
        import torch, rgpu
        session = rgpu.connect()
        x = torch.zeros(8, device="rgpu")
        peak = 0
        for i in range(3000):
            x = x + 1
            peak = max(peak, session.stream.unacked_bytes)
        print(x.sum().item(), peak)
    """
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    total, peak = out.stdout.split()
    assert float(total) == 3000 * 8
    assert int(peak) <= 20000 + 70_000  # the limit, plus at most one batch over it
