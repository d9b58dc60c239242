"""The live stats widget: what the running cell costs the remote device, and recent cells.

Plain ipywidgets 8 (`VBox` of two `HTML`), so it needs no frontend extension. A daemon timer
thread refreshes it at most 10 times a second while it is open. Each refresh assigns value traits
only, inside `hold_sync`, and an unchanged value sends nothing: jupyter_server drops IOPub
messages beyond 1000/s, so a per-op update would lose messages. The thread never prints and never
touches an `Output` widget (output from threads lands in whichever cell runs next).

The text repr is short and free of timings, because frontends without widget support (and nbval)
show and compare it.
"""

from __future__ import annotations

import html
import logging
import threading
from collections.abc import Callable

import ipywidgets as widgets

import rgpu

from .accounting import CellAccounting, CellCost
from .report import format_bytes, format_seconds

log = logging.getLogger("rgpu_jupyter")

MIN_INTERVAL = 0.1  # seconds between refreshes: at most 10 Hz

_STATE_COLOURS = {
    "connected": "#2e7d32",
    "reconnecting": "#ef6c00",
    "lost": "#c62828",
    "closed": "#757575",
    "not connected": "#757575",
}

_CSS = (
    "<style>"
    ".rgpu-w{font-family:var(--jp-ui-font-family,sans-serif);font-size:12px;line-height:1.5}"
    ".rgpu-w .rgpu-dim{color:#757575}"
    ".rgpu-w table{border-collapse:collapse;margin-top:2px}"
    ".rgpu-w td,.rgpu-w th{padding:0 8px 0 0;text-align:right;white-space:nowrap}"
    ".rgpu-w td.rgpu-code,.rgpu-w th.rgpu-code{text-align:left;font-family:var(--jp-code-font-family,monospace)}"
    ".rgpu-w .rgpu-bar{display:inline-block;height:8px;background:#1e88e5;vertical-align:middle}"
    ".rgpu-w tr.rgpu-top td{font-weight:bold}"
    "</style>"
)


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


class RgpuWidget(widgets.VBox):
    """Live view of the running cell's messages, waits, bytes and time, and a recent-cells chart.

    Build it with the `CellAccounting` that records cells; `%rgpu connect` and `%rgpu widget` show
    it. `autostart=False` leaves the timer off (tests then call `refresh()` themselves).
    """

    def __init__(
        self,
        accounting: CellAccounting,
        *,
        interval: float = 0.2,
        rows: int = 8,
        session: Callable[[], dict[str, str]] = session_view,
        autostart: bool = True,
    ) -> None:
        self.live = widgets.HTML()
        self.recent = widgets.HTML()
        super().__init__(children=[self.live, self.recent])
        self.add_class("rgpu-widget")
        self.accounting = accounting
        self.interval = max(MIN_INTERVAL, float(interval))
        self.rows = rows
        self.rtt: float | None = None  # the last round trip measured by %rgpu connect / status
        self.refreshes = 0
        self.errors = 0
        self._session = session
        self._url = ""
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
        while not self._stop.wait(self.interval):
            if self.comm is None:  # the widget was closed
                return
            try:
                self.refresh()
            except Exception:  # never let a render bug surface in someone's cell
                self.errors += 1
                log.debug("rgpu_jupyter: widget refresh failed", exc_info=True)
                if self.errors > 50:
                    return

    # -- rendering ---------------------------------------------------------------------------

    def refresh(self) -> None:
        """Recompute the view and send what changed, as one update per child widget."""
        view = self._session()
        self._url = view["url"]
        live = self.accounting.live()
        recent = self.accounting.recent(self.rows)
        live_html = _CSS + self._render_live(view, live, recent[-1] if recent else None)
        recent_html = _render_recent(recent, self.rows)
        style = {"lost": "danger", "reconnecting": "warning"}.get(
            view["state"], "info" if live else ""
        )
        with self.hold_sync(), self.live.hold_sync(), self.recent.hold_sync():
            self.box_style = style
            self.live.value = live_html
            self.recent.value = recent_html
        self.refreshes += 1

    def _render_live(
        self, view: dict[str, str], live: CellCost | None, last: CellCost | None
    ) -> str:
        state = view["state"]
        colour = _STATE_COLOURS.get(state, "#757575")
        head = [
            f'<b style="color:{colour}">●</b> <span class="rgpu-state">{html.escape(state)}</span>'
        ]
        if view["url"]:
            head.append(f'<span class="rgpu-server">{html.escape(view["url"])}</span>')
        if view["device"]:
            head.append(html.escape(view["device"]))
        if view.get("session"):
            head.append(f'session <span class="rgpu-session">{html.escape(view["session"])}</span>')
        if self.rtt is not None and state == "connected":
            head.append(f"RTT {format_seconds(self.rtt)}")
        if live is not None:
            what, cost = f"running [{live.number}]", live
        elif last is not None:
            what, cost = f"last cell [{last.number}]", last
        else:
            what, cost = "no cell has used rgpu yet", None
        line = f'<span class="rgpu-what">{what}</span>'
        if cost is not None:
            line += (
                f': <span class="rgpu-messages">{cost.messages}</span> messages · '
                f'<span class="rgpu-waits">{cost.waits}</span> waits · '
                f'<span class="rgpu-out">{format_bytes(cost.bytes_out)}</span> out · '
                f'<span class="rgpu-in">{format_bytes(cost.bytes_in)}</span> in · '
                f'<span class="rgpu-elapsed">{format_seconds(cost.wall_seconds)}</span>'
            )
        if view.get("devices"):
            line = f'<span class="rgpu-devices">{html.escape(view["devices"])}</span><br>' + line
        if view.get("kept"):
            line = (
                f'<span class="rgpu-kept">kept: {html.escape(view["kept"])} '
                "(rgpu.kept(NAME) to use)</span><br>" + line
            )
        return f'<div class="rgpu-w rgpu-live">rgpu {" · ".join(head)}<br>{line}</div>'

    def __repr__(self) -> str:
        return f"RgpuWidget(server={self._url or None})"


def _render_recent(rows: list[CellCost], limit: int) -> str:
    """A small table of recent cells with a bar per cell, so the expensive one stands out."""
    if not rows:
        return ""
    rows = rows[-limit:]
    top = max(rows, key=lambda r: (r.wait_seconds, r.waits))
    scale = max(top.wait_seconds, 1e-9)
    body = []
    for r in rows:
        width = max(1, round(80 * r.wait_seconds / scale))
        cls = ' class="rgpu-top"' if r is top and len(rows) > 1 else ""
        mark = "" if r.success else " ✗"
        body.append(
            f"<tr{cls}><td>[{r.number}]{mark}</td><td>{r.messages}</td><td>{r.waits}</td>"
            f"<td>{format_bytes(r.bytes_out)}</td><td>{format_bytes(r.bytes_in)}</td>"
            f"<td>{format_seconds(r.wall_seconds)}</td>"
            f'<td style="text-align:left"><span class="rgpu-bar" style="width:{width}px"></span> '
            f"{format_seconds(r.wait_seconds)}</td>"
            f'<td class="rgpu-code">{html.escape(r.label)}</td></tr>'
        )
    head = (
        "<tr><th>cell</th><th>messages</th><th>waits</th><th>out</th><th>in</th><th>wall</th>"
        '<th style="text-align:left">waiting</th><th class="rgpu-code">code</th></tr>'
    )
    return f'<div class="rgpu-w rgpu-recent"><table>{head}{"".join(body)}</table></div>'
