"""The live widget, built headlessly: its trait values, its update messages, its timer thread.

Widgets normally talk to a frontend through a kernel comm. Here `comm.create_comm` returns a
recording comm (ipywidgets' own test suite does the same with its DummyComm), so every update the
widget would send is a list entry the tests can count.
"""

from __future__ import annotations

import re
import threading
import time
from types import SimpleNamespace

import comm
import ipywidgets
import pytest
import torch

import rgpu
from rgpu_jupyter.accounting import CellAccounting, Snapshot
from rgpu_jupyter.widget import RgpuWidget


class RecordingComm:
    kernel = "a kernel"  # ipywidgets sends only when the comm has one

    def __init__(self, **kwargs):
        self.comm_id = f"comm-{id(self)}"
        self.open_data = kwargs.get("data")
        self.messages: list[dict] = []
        self.closed = False

    def on_msg(self, callback):
        pass

    def send(self, data=None, buffers=None, **kwargs):
        self.messages.append(data)

    def close(self, *args, **kwargs):
        self.closed = True


@pytest.fixture(autouse=True)
def recording_comms(monkeypatch):
    monkeypatch.setattr(comm, "create_comm", lambda **kw: RecordingComm(**kw))
    yield
    # close what the test left open now: a widget's __del__ at interpreter exit trips over
    # ipywidgets' half-torn-down module state and prints a traceback
    ipywidgets.Widget.close_all()


class FakeStats:
    """A stats source the test moves by hand; `token` stands for the session object."""

    def __init__(self):
        self.token = object()
        self.values = {
            "messages": 0,
            "waits": 0,
            "bytes_out": 0,
            "bytes_in": 0,
            "frames": 0,
            "wait_seconds": 0.0,
        }
        self.lock = threading.Lock()

    def add(self, **kw):
        with self.lock:
            for k, v in kw.items():
                self.values[k] += v

    def snapshot(self) -> Snapshot:
        with self.lock:
            return Snapshot(self.token, dict(self.values))


STATE_CLASSES = {"rgpu-running", "rgpu-lost", "rgpu-reconnecting"}
VIEW = {"url": "ws://127.0.0.1:4321", "state": "connected", "device": "cpu (CPU)"}


def make(stats: FakeStats, view=VIEW, **kw) -> tuple[CellAccounting, RgpuWidget]:
    acc = CellAccounting(stats.snapshot, settle=None)
    kw.setdefault("autostart", False)
    return acc, RgpuWidget(acc, session=lambda: dict(view), **kw)


def updates(w) -> list[dict]:
    return [m["state"] for m in w.comm.messages if m.get("method") == "update"]


def span(html: str, name: str) -> str:
    m = re.search(rf'class="rgpu-{name}">([^<]*)<', html)
    assert m, (name, html)
    return m.group(1)


def run_cell(acc: CellAccounting, stats: FakeStats, cell_id: str, **cost):
    info = SimpleNamespace(cell_id=cell_id, raw_cell=f"work({cell_id!r})")
    acc.pre_run_cell(info)
    stats.add(**cost)
    acc.post_run_cell(SimpleNamespace(info=info, success=True))


# -- state ----------------------------------------------------------------------------------


def test_builds_headlessly_and_shows_the_connection():
    _, w = make(FakeStats())
    assert isinstance(w.live.comm, RecordingComm)
    assert span(w.live.value, "state") == "connected"
    assert span(w.live.value, "server") == "ws://127.0.0.1:4321"
    assert "no cell has used rgpu yet" in w.live.value
    assert w.recent.value == ""
    assert not STATE_CLASSES & set(w._dom_classes)


def test_repr_is_short_stable_and_names_only_the_server():
    stats = FakeStats()
    acc, w = make(stats)
    assert repr(w) == "RgpuWidget(server=ws://127.0.0.1:4321)"
    acc.pre_run_cell(SimpleNamespace(cell_id="a", raw_cell="x"))
    stats.add(messages=5, waits=1, wait_seconds=0.25)
    w.refresh()
    assert repr(w) == "RgpuWidget(server=ws://127.0.0.1:4321)"  # no counts, no times
    _, w2 = make(stats, view={"url": "", "state": "not connected", "device": ""})
    assert repr(w2) == "RgpuWidget(server=None)"
    assert w._repr_mimebundle_()["text/plain"] == repr(w)


def test_running_cell_counts_and_elapsed_time_update():
    stats = FakeStats()
    acc, w = make(stats)
    acc.pre_run_cell(SimpleNamespace(cell_id="c1", raw_cell="train()"))
    stats.add(messages=120, waits=2, bytes_out=4096, bytes_in=10)
    w.refresh()
    assert span(w.live.value, "what") == "running [1]"
    assert (span(w.live.value, "messages"), span(w.live.value, "waits")) == ("120", "2")
    assert (span(w.live.value, "out"), span(w.live.value, "in")) == ("4.0 KiB", "10 B")
    assert "rgpu-running" in w._dom_classes
    first = span(w.live.value, "elapsed")
    time.sleep(0.02)
    stats.add(messages=30, waits=1)
    w.refresh()
    assert (span(w.live.value, "messages"), span(w.live.value, "waits")) == ("150", "3")
    assert span(w.live.value, "elapsed") != first
    acc.post_run_cell(SimpleNamespace(info=acc._running.info, success=True))
    w.refresh()
    assert span(w.live.value, "what") == "last cell [1]"
    assert span(w.live.value, "messages") == "150"
    assert not STATE_CLASSES & set(w._dom_classes)


def test_connection_state_is_shown_and_coloured():
    view = dict(VIEW)
    stats = FakeStats()
    acc, w = make(stats, view=view)
    w.rtt = 0.0123
    w.refresh()
    assert span(w.live.value, "rtt") == "12.3 ms"
    view["state"] = "lost"
    w._session = lambda: dict(view)
    w.refresh()
    assert span(w.live.value, "state") == "lost" and "rgpu-lost" in w._dom_classes
    assert "RTT" not in w.live.value
    view["state"] = "reconnecting"
    w.refresh()
    assert span(w.live.value, "state") == "reconnecting"
    assert "rgpu-reconnecting" in w._dom_classes and "rgpu-lost" not in w._dom_classes


def test_history_chart_makes_the_expensive_cell_stand_out():
    stats = FakeStats()
    acc, w = make(stats, rows=3)
    run_cell(acc, stats, "cheap", messages=10, waits=1, wait_seconds=0.001)
    run_cell(acc, stats, "costly", messages=10, waits=40, wait_seconds=0.4)
    run_cell(acc, stats, "cheap2", messages=500, waits=1, wait_seconds=0.002)
    run_cell(acc, stats, "nothing")  # no rgpu traffic: not listed
    w.refresh()
    rows = re.findall(r"<tr( class=\"rgpu-top\")?><td>\[(\d)\]", w.recent.value)
    assert [(bool(top), n) for top, n in rows] == [(False, "1"), (True, "2"), (False, "3")]
    widths = [int(x) for x in re.findall(r'class="rgpu-bar" style="width:(\d+)px"', w.recent.value)]
    assert widths == [1, 80, 1]
    run_cell(acc, stats, "later", messages=1, waits=1, wait_seconds=0.0)
    w.refresh()
    assert "[1]" not in w.recent.value and "[5]" in w.recent.value  # only the last `rows` cells


def test_user_code_in_labels_is_escaped():
    stats = FakeStats()
    acc, w = make(stats)
    info = SimpleNamespace(cell_id="x", raw_cell="%%rgpu\n# comment\ny = '<b>' * 3")
    acc.pre_run_cell(info)
    stats.add(messages=1)
    acc.post_run_cell(SimpleNamespace(info=info, success=True))
    w.refresh()
    assert "y = &#x27;&lt;b&gt;&#x27; * 3" in w.recent.value and "<b>'" not in w.recent.value


# -- messages -------------------------------------------------------------------------------


def test_a_refresh_sends_one_update_per_changed_widget_and_nothing_when_unchanged():
    stats = FakeStats()
    acc, w = make(stats)
    for x in (w, w.live, w.recent):
        x.comm.messages.clear()
    acc.pre_run_cell(SimpleNamespace(cell_id="a", raw_cell="x"))
    stats.add(messages=3)
    w.refresh()
    assert len(updates(w.live)) == 1 and set(updates(w.live)[0]) == {"value"}
    assert updates(w) == [{"_dom_classes": ("rgpu-widget", "rgpu-running")}]
    assert updates(w.recent) == []  # unchanged: nothing sent
    for x in (w, w.live, w.recent):
        x.comm.messages.clear()
    w.refresh()  # nothing moved (the elapsed time did; freeze it by ending the cell first)
    acc.post_run_cell(SimpleNamespace(info=acc._running.info, success=True))
    w.refresh()
    for x in (w, w.live, w.recent):
        x.comm.messages.clear()
    w.refresh()
    assert updates(w) == updates(w.live) == updates(w.recent) == []


def test_hold_sync_batches_the_traits_of_one_refresh(monkeypatch):
    stats = FakeStats()
    acc, w = make(stats)
    sent = []
    original = type(w.live).send_state

    def spy(self, key=None):
        sent.append((self, None if key is None else sorted(key)))
        return original(self, key)

    monkeypatch.setattr(type(w.live), "send_state", spy)
    monkeypatch.setattr(type(w), "send_state", spy)
    acc.pre_run_cell(SimpleNamespace(cell_id="a", raw_cell="x"))
    stats.add(messages=3)
    w.refresh()
    # every send went through hold_sync's exit with the batched keys, never one per assignment
    assert (w.live, ["value"]) in sent and (w, ["_dom_classes"]) in sent
    assert all(key is not None for _, key in sent)


# -- the timer thread -----------------------------------------------------------------------


def test_timer_refreshes_at_most_ten_times_a_second_while_a_cell_runs():
    stats = FakeStats()
    acc, w = make(stats, interval=0.001)
    assert w.interval == 0.1
    acc.pre_run_cell(SimpleNamespace(cell_id="a", raw_cell="x"))
    w.refresh()
    live = w.live.comm
    live.messages.clear()
    w.start()
    seen = []
    t0 = time.monotonic()
    while time.monotonic() - t0 < 0.75:
        stats.add(messages=1)
        seen.append(span(w.live.value, "messages"))
        time.sleep(0.005)
    w.close()
    assert not w.running
    n = len([m for m in live.messages if m.get("method") == "update"])
    assert 3 <= n <= 9, n  # ~7 in 0.75 s at 10 Hz
    assert w.refreshes <= 9
    counts = [int(x) for x in dict.fromkeys(seen)]
    assert len(counts) >= 3 and counts == sorted(counts)  # the numbers moved while "running"


def test_timer_thread_never_raises_or_prints(capsys):
    stats = FakeStats()
    acc, w = make(stats, interval=0.1)

    def broken():
        raise RuntimeError("no session view")

    w._session = broken
    w.start()
    time.sleep(0.35)
    assert w.running and w.errors >= 2
    w.close()
    assert capsys.readouterr() == ("", "")


def test_close_stops_the_thread_and_closes_every_comm():
    _, w = make(FakeStats(), autostart=True)
    assert w.running
    live, recent = w.live.comm, w.recent.comm
    w.close()
    assert not w.running and w.comm is None
    assert live.closed and recent.closed


# -- with a real server ---------------------------------------------------------------------


def test_live_counts_follow_a_real_cell_while_it_runs(dev):
    acc = CellAccounting()
    w = RgpuWidget(acc, interval=0.1, autostart=False)
    x = torch.zeros(16, device=dev)
    for _ in range(3):  # warm the client's plan cache: a cold first op takes most of a second
        x = (x + 1).sum(0, keepdim=True)
    x.sum().item()
    info = SimpleNamespace(cell_id="train", raw_cell="train()")
    acc.pre_run_cell(info)
    w.refresh()
    w.start()
    seen = []
    x = torch.zeros(16, device=dev)
    t0 = time.monotonic()
    steps = 0
    while time.monotonic() - t0 < 1.0:
        for _ in range(20):
            x = x + 1
        x.sum().item()
        steps += 1
        seen.append(span(w.live.value, "messages"))
    acc.post_run_cell(SimpleNamespace(info=info, success=True))
    w.close()
    moving = [int(s) for s in dict.fromkeys(seen) if s]
    assert len(moving) >= 3 and moving == sorted(moving)
    (row,) = acc.recent()
    assert row.waits == steps  # exactly one wait per .item()
    # a step: its 21 ops (once it repeats, one REPLAY for them), the .item() and frees
    assert row.messages >= 2 * steps
    assert span(w.live.value, "server") == rgpu.current_session().url


# -- the device, the link, transfers, advice --------------------------------------------------

CPU_FACTS = {
    "tensors": 2, "bytes": 4096, "memory_used": 3 << 30, "memory_total": 24 << 30,
    "memory_process": 200 << 20, "utilization": None,
    "utilization_note": "n/a on a CPU server", "load_average": 1.5, "cpus": 2,
}  # fmt: skip


def test_probe_fills_in_round_trip_and_device_memory():
    probes = []
    _, w = make(FakeStats(), probe=lambda: probes.append(1) or (0.0042, dict(CPU_FACTS)))
    assert "rgpu-memory" not in w.live.value  # nothing known before the first probe
    w.probe_now()
    w.refresh()
    assert span(w.live.value, "rtt") == "4.2 ms"
    assert span(w.live.value, "memory") == (
        "3.0 GiB / 24.0 GiB host RAM, this session 4.0 KiB (server process 200.0 MiB)"
    )
    assert span(w.live.value, "util") == "n/a on a CPU server (load 1.50 on 2 cores)"
    assert 'class="rgpu-meter"><span style="width:12%">' in w.live.value
    assert probes == [1] and w.probes == 1


def test_a_skipped_probe_keeps_the_last_values():
    answers = [(0.002, dict(CPU_FACTS)), None]
    _, w = make(FakeStats(), probe=lambda: answers.pop(0))
    w.probe_now()
    w.probe_now()  # a transfer is in flight: nothing asked
    w.refresh()
    assert span(w.live.value, "rtt") == "2.0 ms" and w.probes == 1


def test_the_timer_probes_every_two_seconds_not_every_refresh(monkeypatch):
    import rgpu_jupyter.widget as widget_module

    monkeypatch.setattr(widget_module, "PROBE_S", 0.25)
    calls = []
    _, w = make(FakeStats(), interval=0.1, probe=lambda: calls.append(time.monotonic()))
    w.start()
    time.sleep(0.8)
    w.close()
    assert 2 <= len(calls) <= 5 and w.refreshes >= 5


def test_a_transfer_in_flight_shows_its_progress():
    moving = [("rgpu download", 120 << 20, 381 << 20, 2.0)]
    stats = FakeStats()
    acc, w = make(stats, transfers=lambda: list(moving))
    acc.pre_run_cell(SimpleNamespace(cell_id="a", raw_cell="x.cpu()"))
    w.refresh()
    assert re.search(
        r'class="rgpu-transfer">rgpu download <span class="rgpu-meter"><span style="width:31%">'
        r"</span></span>120.0 MiB / 381.0 MiB \(31%\)</span>",
        w.live.value,
    )
    moving.clear()
    w.refresh()
    assert "rgpu-transfer" not in w.live.value


def test_advice_shows_for_a_cell_that_mostly_waited_and_not_otherwise():
    stats = FakeStats()
    acc, w = make(stats)
    run_cell(acc, stats, "fine", messages=5, waits=1, wait_seconds=0.001)
    w.refresh()
    assert 'class="rgpu-advice"' not in w.live.value and w.advice is None
    info = SimpleNamespace(cell_id="slow", raw_cell="loop()")
    acc.pre_run_cell(info)
    acc._running.t0 -= 1.0  # the cell has run a second, most of it waiting
    stats.add(messages=40, waits=40, wait_seconds=0.9)
    w.refresh()
    assert span(w.live.value, "advice").startswith("advice: 40 waits, each a round trip")


def test_compact_mode_is_one_line_without_the_chart():
    stats = FakeStats()
    acc, w = make(stats, compact=True, probe=lambda: (0.001, dict(CPU_FACTS)))
    run_cell(acc, stats, "a", messages=3, waits=1, wait_seconds=0.001)
    w.probe_now()
    w.refresh()
    assert w.recent.value == "" and "<br>" not in w.live.value
    assert span(w.live.value, "what") == "[1]" and span(w.live.value, "waits") == "1"
    assert "1</span> wait ·" in w.live.value  # "1 wait", not "1 waits"
    assert span(w.live.value, "memory") == "3.0 GiB / 24.0 GiB"
    w.compact = False
    w.refresh()
    assert "[1]" in w.recent.value


def test_one_wait_is_singular_in_the_full_view():
    stats = FakeStats()
    acc, w = make(stats)
    run_cell(acc, stats, "a", messages=1, waits=1)
    w.refresh()
    assert "1</span> message ·" in w.live.value and "1</span> wait ·" in w.live.value


def test_the_page_can_say_the_kernel_is_gone_on_its_own():
    """After a restart no update comes: the view carries a 'kernel gone' state that CSS shows
    when the widget manager marks the view disconnected."""
    _, w = make(FakeStats())
    assert '<span class="rgpu-alive">' in w.live.value
    assert 'class="rgpu-state-gone">kernel gone: this view is stale<' in w.live.value
    assert ".jupyter-widgets-disconnected .rgpu-w .rgpu-alive{display:none}" in w.live.value
    assert ".jupyter-widgets-disconnected .rgpu-w .rgpu-gone{display:inline}" in w.live.value
