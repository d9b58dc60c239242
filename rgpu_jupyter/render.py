"""The widget's HTML, and the device facts in words (shared with `%rgpu status`).

Pure functions of plain values, so they are tested without a widget. Colours come from
JupyterLab's theme variables (with light-theme fallbacks), so light and dark themes both read.

The state line carries its own staleness: when the kernel goes (restart, shutdown), the widget
manager marks every view of the old kernel's widgets `jupyter-widgets-disconnected`, and the CSS
below then hides "connected" and shows "kernel gone" instead, with no kernel left to send it.
"""

from __future__ import annotations

import html

from .accounting import CellCost
from .report import format_bytes, format_seconds, plural

_STATE_COLOURS = {
    "connected": "var(--jp-success-color1, #2e7d32)",
    "reconnecting": "var(--jp-warn-color1, #ef6c00)",
    "lost": "var(--jp-error-color1, #c62828)",
}
_DIM = "var(--jp-ui-font-color2, #757575)"

CSS = (
    "<style>"
    ".rgpu-w{font-family:var(--jp-ui-font-family,sans-serif);font-size:12px;line-height:1.5;"
    "color:var(--jp-ui-font-color1,inherit)}"
    f".rgpu-w .rgpu-dim{{color:{_DIM}}}"
    ".rgpu-w table{border-collapse:collapse;margin-top:2px}"
    ".rgpu-w td,.rgpu-w th{padding:0 8px 0 0;text-align:right;white-space:nowrap}"
    ".rgpu-w td.rgpu-code,.rgpu-w th.rgpu-code{text-align:left;"
    "font-family:var(--jp-code-font-family,monospace)}"
    ".rgpu-w .rgpu-bar{display:inline-block;height:8px;vertical-align:middle;"
    "background:var(--jp-brand-color1,#1e88e5)}"
    ".rgpu-w .rgpu-meter{display:inline-block;width:60px;height:8px;vertical-align:middle;"
    "background:var(--jp-layout-color3,#ddd);margin:0 4px}"
    ".rgpu-w .rgpu-meter>span{display:block;height:100%;background:var(--jp-brand-color1,#1e88e5)}"
    ".rgpu-w tr.rgpu-top td{font-weight:bold}"
    ".rgpu-w .rgpu-advice{color:var(--jp-warn-color0,#bf360c)}"
    # the box's state: a visible border in both themes (ipywidgets' box_style classes have no
    # CSS in JupyterLab)
    ".rgpu-widget{border-left:3px solid transparent;padding-left:6px}"
    ".rgpu-widget.rgpu-running{border-left-color:var(--jp-brand-color1,#1e88e5)}"
    ".rgpu-widget.rgpu-reconnecting{border-left-color:var(--jp-warn-color1,#ef6c00)}"
    ".rgpu-widget.rgpu-lost{border-left-color:var(--jp-error-color1,#c62828)}"
    # the kernel is gone: no update will come, so the page itself says so
    ".rgpu-w .rgpu-gone{display:none}"
    ".jupyter-widgets-disconnected .rgpu-w .rgpu-gone{display:inline}"
    ".jupyter-widgets-disconnected .rgpu-w .rgpu-alive{display:none}"
    ".jupyter-widgets-disconnected .rgpu-w{opacity:0.6}"
    "</style>"
)


def state_html(state: str) -> str:
    """The dot and the state; replaced by "kernel gone" on the page when the kernel goes."""
    colour = _STATE_COLOURS.get(state, _DIM)
    return (
        f'<span class="rgpu-alive"><b style="color:{colour}">●</b> '
        f'<span class="rgpu-state">{html.escape(state)}</span></span>'
        f'<span class="rgpu-gone"><b style="color:{_DIM}">●</b> '
        '<span class="rgpu-state-gone">kernel gone: this view is stale</span></span>'
    )


# -- device facts in words ----------------------------------------------------------------------


def memory_text(facts: dict) -> str | None:
    """`3.0 GiB / 23.5 GiB host RAM, this session 4.0 KiB (server 224.2 MiB)`, or None."""
    used, total = facts.get("memory_used"), facts.get("memory_total")
    if used is None or total is None:
        return None
    kind = "host RAM" if "load_average" in facts else "device memory"
    text = f"{format_bytes(used)} / {format_bytes(total)} {kind}"
    if facts.get("bytes") is not None:
        text += f", this session {format_bytes(facts['bytes'])}"
    if facts.get("memory_process") is not None:
        text += f" (server process {format_bytes(facts['memory_process'])})"
    return text


def utilization_text(facts: dict) -> str:
    """`87% (NVML)`, or `n/a on a CPU server (load 1.93 on 2 cores)`, or why it is unknown."""
    util = facts.get("utilization")
    note = str(facts.get("utilization_note") or "unknown")
    if util is not None:
        return f"{util}% ({note})"
    load, cpus = facts.get("load_average"), facts.get("cpus")
    if load is not None:
        note += f" (load {load:.2f} on {plural(cpus, 'core') if cpus else '? cores'})"
    return note


def meter(used: float, total: float) -> str:
    share = 0.0 if not total else max(0.0, min(1.0, used / total))
    return f'<span class="rgpu-meter"><span style="width:{share * 100:.0f}%"></span></span>'


def time_split(cost: CellCost) -> str:
    """`3.21 s, 2.50 s of it waiting (78%)`: where the cell's time went."""
    wall, wait = cost.wall_seconds, cost.wait_seconds
    text = format_seconds(wall)
    if wait > 0 and wall > 0:
        text += f", {format_seconds(wait)} of it waiting ({min(100, round(100 * wait / wall))}%)"
    return text


# -- the widget's parts ----------------------------------------------------------------------


def head_html(view: dict[str, str], rtt: float | None) -> list[str]:
    head = [state_html(view["state"])]
    if view["url"]:
        head.append(f'<span class="rgpu-server">{html.escape(view["url"])}</span>')
    if view["device"]:
        head.append(html.escape(view["device"]))
    if view.get("session"):
        head.append(f'session <span class="rgpu-session">{html.escape(view["session"])}</span>')
    if rtt is not None and view["state"] == "connected":
        head.append(f'RTT <span class="rgpu-rtt">{format_seconds(rtt)}</span>')
    return head


def device_html(facts: dict | None) -> str:
    if not facts:
        return ""
    parts = []
    mem = memory_text(facts)
    if mem is not None:
        parts.append(
            "memory"
            + meter(facts["memory_used"], facts["memory_total"])
            + f'<span class="rgpu-memory">{html.escape(mem)}</span>'
        )
    parts.append(f'use <span class="rgpu-util">{html.escape(utilization_text(facts))}</span>')
    return " · ".join(parts)


def cost_html(what: str, cost: CellCost | None) -> str:
    line = f'<span class="rgpu-what">{what}</span>'
    if cost is None:
        return line
    return line + (
        f': <span class="rgpu-messages">{cost.messages}</span> '
        f"{'message' if cost.messages == 1 else 'messages'} · "
        f'<span class="rgpu-waits">{cost.waits}</span> {"wait" if cost.waits == 1 else "waits"} · '
        f'<span class="rgpu-out">{format_bytes(cost.bytes_out)}</span> out · '
        f'<span class="rgpu-in">{format_bytes(cost.bytes_in)}</span> in · '
        f'<span class="rgpu-elapsed">{time_split(cost)}</span>'
    )


def transfers_html(transfers: list[tuple[str, int, int, float]]) -> str:
    """Transfers in flight, with their progress (a long download is not "0 B" until it ends)."""
    rows = []
    for desc, done, total, _ in transfers:
        pct = 100 * done // total if total else 0
        rows.append(
            f'<span class="rgpu-transfer">{html.escape(desc)} {meter(done, total)}'
            f"{format_bytes(done)} / {format_bytes(total)} ({pct}%)</span>"
        )
    return "<br>".join(rows)


def compact_html(view: dict[str, str], cost: CellCost | None, running: bool,
                 facts: dict | None, rtt: float | None) -> str:  # fmt: skip
    """The one-line form: state, the running (or last) cell, memory, round trip."""
    parts = [state_html(view["state"])]
    if cost is not None:
        parts.append(
            f'<span class="rgpu-what">[{cost.number}]{" running" if running else ""}</span> '
            f'<span class="rgpu-messages">{cost.messages}</span> msg · '
            f'<span class="rgpu-waits">{cost.waits}</span> {"wait" if cost.waits == 1 else "waits"}'
            f' · <span class="rgpu-elapsed">{format_seconds(cost.wall_seconds)}</span>'
        )
    if facts and facts.get("memory_used") is not None and facts.get("memory_total"):
        parts.append(
            f'mem <span class="rgpu-memory">{format_bytes(facts["memory_used"])} / '
            f"{format_bytes(facts['memory_total'])}</span>"
        )
    if rtt is not None and view["state"] == "connected":
        parts.append(f'RTT <span class="rgpu-rtt">{format_seconds(rtt)}</span>')
    return f'<div class="rgpu-w rgpu-live rgpu-compact">rgpu {" · ".join(parts)}</div>'


def recent_html(rows: list[CellCost], limit: int) -> str:
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
