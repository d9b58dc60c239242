"""How cell costs are written for people: the `%%rgpu` line and the `%rgpu stats` table.

The `%%rgpu` line has one fixed format, because notebooks check it as output:

    rgpu: 104 messages, 1 wait, 3.3 KiB out, 12 B in

Counts are exact; bytes use binary units with one decimal. Times never appear in that line.

All three repeat from run to run for the same code: the client sends FREE messages at op
boundaries (waits, or when freed tensors pile up), never on a timer, and counts bytes per message
and per tensor payload, not per frame. Notebooks compare them exactly.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

from .accounting import CellCost


def format_bytes(n: float) -> str:
    """`512 B`, `3.3 KiB`, `64.0 MiB`: exact below 1 KiB, one decimal above."""
    n = float(n)
    if abs(n) < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")


def format_seconds(s: float | None) -> str:
    """`850 µs`, `12.5 ms`, `3.21 s`: three significant figures, the unit a person expects;
    `—` for none at all and `<1 µs` for a sliver (never a misleading `0 µs`)."""
    if s is None or s <= 0:
        return "—"
    if s < 0.5e-6:
        return "<1 µs"
    if s < 1e-3:
        return f"{s * 1e6:.0f} µs"
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    return f"{s:.2f} s"


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def cell_line(cost: CellCost) -> str:
    """The one-line summary `%%rgpu` prints after its cell (deterministic fields only)."""
    return (
        f"rgpu: {plural(cost.messages, 'message')}, {plural(cost.waits, 'wait')}, "
        f"{format_bytes(cost.bytes_out)} out, {format_bytes(cost.bytes_in)} in"
    )


_COLUMNS = ("cell", "messages", "waits", "out", "in", "wait", "wall", "code")


def _row(c: CellCost) -> tuple[str, ...]:
    return (
        f"[{c.number}]" + ("" if c.success else "!"),
        str(c.messages),
        str(c.waits),
        format_bytes(c.bytes_out),
        format_bytes(c.bytes_in),
        format_seconds(c.wait_seconds),
        format_seconds(c.wall_seconds),
        c.label,
    )


class CellStats:
    """Recent cells' costs, as `%rgpu stats -o` returns them: a text table and an HTML table.

    `rows` holds the `CellCost` records (oldest first); `as_dicts()` gives plain dicts, e.g. for
    `pandas.DataFrame(stats.as_dicts())`. `[n]` is the order cells ran in this kernel; `!` marks
    a cell that raised.
    """

    def __init__(self, rows: Sequence[CellCost]) -> None:
        self.rows = list(rows)

    def as_dicts(self) -> list[dict]:
        return [r.as_dict() for r in self.rows]

    def __len__(self) -> int:
        return len(self.rows)

    def __repr__(self) -> str:
        if not self.rows:
            return "rgpu: no cell has used the remote device yet"
        table = [_COLUMNS, *(_row(r) for r in self.rows)]
        widths = [max(len(row[i]) for row in table) for i in range(len(_COLUMNS))]
        # bytes and times get fixed widths: they vary run to run, and the layout must not
        widths[3:7] = [max(w, 10) for w in widths[3:7]]
        lines = []
        for row in table:
            cells = [row[0].ljust(widths[0])]
            cells += [v.rjust(w) for v, w in zip(row[1:-1], widths[1:-1])]
            cells.append(row[-1])
            lines.append("  ".join(cells).rstrip())
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        if not self.rows:
            return "<p>rgpu: no cell has used the remote device yet</p>"
        head = "".join(f"<th>{c}</th>" for c in _COLUMNS)
        most = max(self.rows, key=lambda r: (r.waits, r.wait_seconds))
        body = []
        for r in self.rows:
            cells = "".join(f"<td>{html.escape(v)}</td>" for v in _row(r)[:-1])
            cells += f"<td><code>{html.escape(r.label)}</code></td>"
            style = ' style="font-weight:bold"' if r is most and len(self.rows) > 1 else ""
            body.append(f"<tr{style}>{cells}</tr>")
        return f'<table class="rgpu-stats"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'
