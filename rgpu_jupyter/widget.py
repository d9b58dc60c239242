"""The live stats widget: what the running cell costs the remote device, the device's memory and
use, the link's round trip, transfers in flight, advice, and recent cells.

Plain ipywidgets 8 (`VBox` of two `HTML`), so it needs no frontend extension. A daemon timer
thread refreshes it at most 10 times a second while it is open. Each refresh assigns value traits
only, inside `hold_sync`, and an unchanged value sends nothing: jupyter_server drops IOPub
messages beyond 1000/s, so a per-op update would lose messages. The thread never prints and never
touches an `Output` widget (output from threads lands in whichever cell runs next).

Every `PROBE_S` seconds the same thread measures the round trip (a websocket ping) and asks the
server for its device facts (a PEEK frame, `rgpu.peek`): neither is a message or a wait, neither
shows in `rgpu.stats()`, and neither is sent while a large transfer is in flight (the answer would
queue behind it and measure the transfer, not the link).

The text repr is short and free of timings, because frontends without widget support (and nbval)
show and compare it.
"""

from __future__ import annotations

import html
import logging
import threading
import time
from collections.abc import Callable

import ipywidgets as widgets

import rgpu
from rgpu.peek import round_trip
from rgpu.progress import active_transfers

from .accounting import CellAccounting
from .advice import advise
from .render import (
    CSS,
    compact_html,
    cost_html,
    device_html,
    head_html,
    recent_html,
    transfers_html,
)

log = logging.getLogger("rgpu_jupyter")

MIN_INTERVAL = 0.1  # seconds between refreshes: at most 10 Hz
PROBE_S = 2.0  # seconds between round-trip and device-fact probes
SHOWN_TRANSFER = 1 << 20  # transfers this big are listed while in flight...
SHOWN_AFTER_S = 0.3  # ...or any that has taken this long


def session_view() -> dict[str, str]:
    """Where the current session points and its state, without touching the network."""
    s = rgpu.current_session()
    if s is None:
        return {"url": "", "state": "not connected", "device": ""}
    view = {"url": s.url, "state": s.state, "device": f"{s.device} ({s.device_name})"}
    devices = rgpu.device_list()
    if len(devices) > 1:  # several devices (servers): each with its state
        view["device"] = f"{len(devices)} devices"
        view["devices"] = " · ".join(
            f"{d['device']} {d['name']}" + ("" if d["state"] == "connected" else f" ({d['state']})")
            for d in devices
        )
    if getattr(s, "name", None):
        view["session"] = s.name
        kept = s.welcome.kept if s.welcome.attached else ()
        if kept:  # re-opened after a restart: what it offers
            view["kept"] = ", ".join(kept)
    return view


def shown_transfers() -> list[tuple[str, int, int, float]]:
    """The transfers in flight worth showing (big, or slow)."""
    return [t for t in active_transfers() if t[2] >= SHOWN_TRANSFER or t[3] >= SHOWN_AFTER_S]


def probe_session() -> tuple[float | None, dict | None] | None:
    """(round trip, device facts) of the current session, or None when now is no time to ask
    (not connected, or a large transfer is in flight)."""
    s = rgpu.current_session()
    if s is None or s.state != "connected" or shown_transfers():
        return None
    return round_trip(s), s.peek()


class RgpuWidget(widgets.VBox):
    """Live view of the running cell's messages, waits, bytes and time, the device, and a
    recent-cells chart. One per kernel: `%rgpu connect` and `%rgpu widget` show it again
    (rgpu_jupyter.placement) rather than build another.

    Build it with the `CellAccounting` that records cells. `autostart=False` leaves the timer
    off (tests then call `refresh()` and `probe_now()` themselves). `compact` shows one line.
    """

    def __init__(
        self,
        accounting: CellAccounting,
        *,
        interval: float = 0.2,
        rows: int = 8,
        session: Callable[[], dict[str, str]] = session_view,
        probe: Callable[[], tuple[float | None, dict | None] | None] = probe_session,
        transfers: Callable[[], list] = shown_transfers,
        autostart: bool = True,
        compact: bool = False,
    ) -> None:
        self.live = widgets.HTML()
        self.recent = widgets.HTML()
        super().__init__(children=[self.live, self.recent])
        self.add_class("rgpu-widget")
        self.accounting = accounting
        self.interval = max(MIN_INTERVAL, float(interval))
        self.rows = rows
        self.compact = compact
        self.rtt: float | None = None  # the last round trip measured (a probe, or %rgpu status)
        self.facts: dict | None = None  # the server's last device facts (PEEK or INFO)
        self.advice: str | None = None  # what the shown cell's advice is, if any
        self.refreshes = 0
        self.probes = 0
        self.errors = 0
        self._session = session
        self._probe = probe
        self._transfers = transfers
        self._url = ""
        self._state_class = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.refresh()
        if autostart:
            self.start()

    # -- the timer ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start the refresh thread (idempotent)."""
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="rgpu-widget", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=2)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def close(self) -> None:
        self.stop()
        for child in (self.live, self.recent):
            child.close()
        super().close()

    def _run(self) -> None:
        next_probe = time.monotonic()
        while not self._stop.wait(self.interval):
            if self.comm is None:  # the widget was closed
                return
            try:
                if time.monotonic() >= next_probe:
                    self.probe_now()
                    next_probe = time.monotonic() + PROBE_S
                self.refresh()
            except Exception:  # never let a render bug surface in someone's cell
                self.errors += 1
                log.debug("rgpu_jupyter: widget refresh failed", exc_info=True)
                if self.errors > 50:
                    return

    def probe_now(self) -> None:
        """Measure the round trip and read the device facts now (when the probe says it may)."""
        got = self._probe()
        if got is None:
            return
        rtt, facts = got
        if rtt is not None:
            self.rtt = rtt
        if facts is not None:
            self.facts = facts
        self.probes += 1

    # -- rendering ---------------------------------------------------------------------------

    def refresh(self) -> None:
        """Recompute the view and send what changed, as one update per child widget."""
        view = self._session()
        self._url = view["url"]
        live = self.accounting.live()
        recent = self.accounting.recent(self.rows)
        last = recent[-1] if recent else None
        shown = live if live is not None else last
        self.advice = advise(shown, self.rtt) if shown is not None else None
        connected = view["state"] == "connected"
        facts = self.facts if connected else None
        if self.compact:
            live_html = CSS + compact_html(view, shown, live is not None, facts, self.rtt)
            recent_value = ""
        else:
            live_html = CSS + self._render_live(view, live, last, facts)
            recent_value = recent_html(recent, self.rows)
        state = view["state"] if view["state"] in ("lost", "reconnecting") else ""
        state = state or ("running" if live is not None else "")
        with self.hold_sync(), self.live.hold_sync(), self.recent.hold_sync():
            if state != self._state_class:
                if self._state_class:
                    self.remove_class(f"rgpu-{self._state_class}")
                if state:
                    self.add_class(f"rgpu-{state}")
                self._state_class = state
            self.live.value = live_html
            self.recent.value = recent_value
        self.refreshes += 1

    def _render_live(self, view: dict[str, str], live, last, facts: dict | None) -> str:
        lines = [f"rgpu {' · '.join(head_html(view, self.rtt))}"]
        device = device_html(facts)
        if device:
            lines.append(f'<span class="rgpu-device">{device}</span>')
        if view.get("devices"):
            lines.append(f'<span class="rgpu-devices">{html.escape(view["devices"])}</span>')
        if view.get("kept"):
            lines.append(
                f'<span class="rgpu-kept">kept: {html.escape(view["kept"])} '
                "(rgpu.kept(NAME) to use)</span>"
            )
        if live is not None:
            lines.append(cost_html(f"running [{live.number}]", live))
        elif last is not None:
            lines.append(cost_html(f"last cell [{last.number}]", last))
        else:
            lines.append(cost_html("no cell has used rgpu yet", None))
        moving = transfers_html(self._transfers())
        if moving:
            lines.append(moving)
        if self.advice:
            lines.append(f'<span class="rgpu-advice">advice: {html.escape(self.advice)}</span>')
        return f'<div class="rgpu-w rgpu-live">{"<br>".join(lines)}</div>'

    def __repr__(self) -> str:
        return f"RgpuWidget(server={self._url or None})"
