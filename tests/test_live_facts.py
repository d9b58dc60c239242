"""Live facts for live views: INFO's device fields, PEEK frames answered out of band, the round-trip
probe, and transfers in flight. None of them may move the counters notebooks compare."""

from __future__ import annotations

import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from rgpu_server import devices

import rgpu
import rgpu.progress as progress
import rgpu_protocol as proto
from rgpu.peek import round_trip

LIVE_KEYS = {"memory_used", "memory_total", "memory_process", "utilization", "utilization_note"}


# -- the wire --------------------------------------------------------------------------------


def test_peek_frames_round_trip_and_refuse_bad_lengths():
    assert proto.parse_peek(proto.peek_frame(2**64 - 1)) == 2**64 - 1
    token, facts = proto.parse_peek_reply(proto.peek_reply_frame(7, {"memory_used": 5}))
    assert (token, facts) == (7, {"memory_used": 5})
    with pytest.raises(proto.ProtocolError):
        proto.parse_peek(proto.peek_frame(1) + b"x")
    with pytest.raises(proto.ProtocolError):
        proto.parse_peek_reply(bytes((proto.Frame.PEEK_REPLY,)) + bytes(8) + b"\x01")  # not a map


def test_welcome_says_whether_the_server_answers_peek():
    base = proto.Welcome("0.1", "2.13", b"s" * 16, "cpu", "CPU")
    assert proto.Welcome.parse(base.frame()).peek is False  # an older server's WELCOME
    assert proto.Welcome.parse(proto.Welcome(**{**base.__dict__, "peek": True}).frame()).peek


# -- the server's facts ----------------------------------------------------------------------


def test_cpu_facts_come_from_proc_and_name_what_is_missing():
    facts = devices.live_facts(torch.device("cpu"))
    assert LIVE_KEYS <= set(facts)
    assert 0 < facts["memory_used"] < facts["memory_total"]
    assert 0 < facts["memory_process"] < facts["memory_total"]
    assert facts["utilization"] is None and facts["utilization_note"] == "n/a on a CPU server"
    assert facts["cpus"] == __import__("os").cpu_count() and facts["load_average"] >= 0


def test_cuda_utilisation_comes_from_nvml_matched_by_uuid(monkeypatch):
    calls = []
    fake = SimpleNamespace(
        nvmlInit=lambda: calls.append("init"),
        nvmlDeviceGetHandleByUUID=lambda u: calls.append(u) or "handle",
        nvmlDeviceGetHandleByIndex=lambda i: pytest.fail("matched by index"),
        nvmlDeviceGetUtilizationRates=lambda h: SimpleNamespace(gpu=87, memory=40),
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(devices, "_nvml", {})
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (30 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 12 << 30)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda d: SimpleNamespace(uuid="1234-abcd")
    )
    facts = devices.live_facts(torch.device("cuda", 0))
    assert facts == {
        "memory_used": 50 << 30,
        "memory_total": 80 << 30,
        "memory_process": 12 << 30,
        "utilization": 87,
        "utilization_note": "NVML",
    }
    assert calls == ["init", "GPU-1234-abcd"]
    devices.live_facts(torch.device("cuda", 0))
    assert calls == ["init", "GPU-1234-abcd"]  # the handle is kept


def test_cuda_without_nvml_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    monkeypatch.setattr(devices, "_nvml", {})
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (1, 3))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 0)
    facts = devices.live_facts(torch.device("cuda", 0))
    assert facts["utilization"] is None
    assert facts["utilization_note"] == "no NVML on the server (pip install nvidia-ml-py)"


# -- end to end ------------------------------------------------------------------------------


def test_info_carries_the_live_fields(session, dev):
    keep = torch.ones(1024, device=dev)
    info = session.info()
    assert LIVE_KEYS <= set(info) and info["bytes"] >= 4096
    assert info["memory_total"] > info["memory_used"] > 0
    del keep


def test_peek_is_answered_and_counts_nowhere(counted, session, dev):
    keep = torch.ones(1024, device=dev)
    torch.rgpu.synchronize()
    before = counted()
    facts = session.peek()
    rtt = round_trip(session)
    assert facts is not None and LIVE_KEYS <= set(facts)
    assert facts["tensors"] >= 1 and facts["bytes"] >= 4096
    assert rtt is not None and 0 < rtt < 5
    assert counted() == before  # not a message, a wait, a frame or a byte the user sees
    del keep


def test_peek_is_not_behind_the_queued_work(session, dev):
    """A cell keeping the server busy for seconds: a peek is still answered at once."""
    x = torch.randn(512, 512, device=dev)
    for _ in range(60):
        x = (x @ x).tanh()
    session.flush()
    t0 = time.perf_counter()
    facts = session.peek(timeout=5)
    took = time.perf_counter() - t0
    x.sum().item()  # the work itself
    assert facts is not None and took < 1.0, took


def test_peek_leaves_a_pending_failure_for_the_next_wait(session, dev):
    src = torch.arange(5.0, device=dev)
    torch.gather(src, 0, torch.tensor([0, 7], device=dev))
    session.flush()
    time.sleep(0.2)
    assert session.peek() is not None
    with pytest.raises(rgpu.RemoteError, match="index 7"):
        torch.rgpu.synchronize()


def test_round_trip_probe_leaves_the_sessions_own_measure_alone(session):
    session.link.rtt_s = 0.123
    assert round_trip(session) is not None
    assert session.link.rtt_s == 0.123  # compression and the lane decide on it


def test_an_older_server_is_not_peeked(session):
    welcome = session.welcome
    session.welcome = proto.Welcome(**{**welcome.__dict__, "peek": False})
    try:
        assert session.peek() is None
    finally:
        session.welcome = welcome


# -- transfers in flight ---------------------------------------------------------------------


def test_transfers_in_flight_are_listed_until_closed():
    t = progress.TransferProgress(1000, "rgpu download")
    t.update_to(250)
    (desc, done, total, age), *_ = [x for x in progress.active_transfers() if x[0] == t.desc]
    assert (desc, done, total) == ("rgpu download", 250, 1000) and age >= 0
    t.close()
    assert all(x[2] != 1000 for x in progress.active_transfers())


def test_a_bar_closed_short_of_its_total_disappears(monkeypatch):
    """tqdm's notebook bar stays, red and frozen ("0% 0.00/381M"), when closed before its total;
    a finished (or failed) transfer's bar must go."""
    closed = []

    class Bar:
        def __init__(self, total, **kw):
            self.total, self.n = total, 0

        def update(self, k):
            self.n += k

        def close(self):
            closed.append((self.n, self.total))

    monkeypatch.setattr("tqdm.auto.tqdm", Bar)
    monkeypatch.setattr(progress.settings, "_progress_bytes", 100)
    t = progress.TransferProgress(400, "rgpu download")
    t.update_to(0)  # the reply landed before the first progress update
    t.close()
    assert closed == [(400, 400)]


def test_a_download_shows_its_progress_while_it_runs(session, dev, monkeypatch):
    seen = []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            seen.extend(t for t in progress.active_transfers() if t[0] == "rgpu download")
            time.sleep(0.001)

    monkeypatch.setattr(session.link, "lane_enabled", False)
    big = torch.ones(4 << 20, device=dev)  # 16 MiB
    torch.rgpu.synchronize()
    watcher = threading.Thread(target=watch)
    watcher.start()
    big.cpu()
    stop.set()
    watcher.join()
    assert seen and {t[2] for t in seen} == {16 << 20}
    assert not [t for t in progress.active_transfers() if t[0] == "rgpu download"]
