"""The per-cell advisor: when a cell spent most of its time waiting on the server, one line that
says why and what to change, from what the accounting already knows (counters, the user's line
that waited most, uploads the server already had).

It says nothing when nothing is wrong: a cell that waited less than half its wall time, or less
than `MIN_WAIT_S` in all, gets no advice, nor does one whose few waits were long (the server was
computing: the device's speed is the cost, and that is no mistake of the notebook's). The widget shows the advice of the running (or last)
cell; `%%rgpu` prints it under its line; ordinary cells' outputs never get it.
"""

from __future__ import annotations

import linecache

from rgpu.sites import describe

from .accounting import CellCost
from .report import format_bytes, format_seconds, plural

MIN_WAIT_S = 0.2  # below this a cell's waiting is not worth a remark
WAIT_SHARE = 0.5  # ...nor when it is less than this share of the cell's wall time
MANY_WAITS = 10  # one line waiting this often is the cause
BIG_DEDUP = 16 << 20  # re-sent data worth a remark
BIG_TRANSFER = 64 << 20  # bytes moved in a cell worth a remark


def advise(cost: CellCost, rtt: float | None = None) -> str | None:
    """One line for a cell that mostly waited (why, and the fix), or None."""
    if cost.wait_seconds < MIN_WAIT_S or cost.wait_seconds < WAIT_SHARE * cost.wall_seconds:
        return None
    if cost.dedup_hits and cost.dedup_bytes_saved >= BIG_DEDUP:
        each = format_bytes(cost.dedup_bytes_saved / cost.dedup_hits)
        return (
            f"re-uploaded the same {each} {plural(cost.dedup_hits, 'time')} "
            "(the server had it): keep it on rgpu, move it once before the loop"
        )
    if cost.busiest is not None and cost.busiest_waits >= MANY_WAITS:
        code = source_line(cost.busiest)
        what = f"`{code}`" if code else "one line"
        per = f" (a round trip of {format_seconds(rtt)} each)" if rtt else ""
        return (
            f"{cost.busiest_waits} waits from {what} at {describe(cost.busiest)}{per}: "
            f"{fix_for(code)}"
        )
    moved = cost.bytes_in + cost.bytes_out
    if moved >= BIG_TRANSFER:
        return (
            f"moved {format_bytes(cost.bytes_out)} out and {format_bytes(cost.bytes_in)} in: "
            "the link's bandwidth is the cost; keep data on rgpu (rgpu.files puts files on the "
            "server) and bring back only results"
        )
    if cost.waits >= MANY_WAITS:
        return (
            f"{cost.waits} waits, each a round trip: read values less often, or with "
            '.to("cpu", non_blocking=True) (not a wait)'
        )
    return None  # a few long waits: the device was computing, which is its job, not a problem


def fix_for(code: str) -> str:
    """What to change in a line of code that waits on every run."""
    c = code.replace(" ", "")
    if ".item()" in c or c.startswith(("float(", "int(")) or "=float(" in c or "=int(" in c:
        return 'read it with .to("cpu", non_blocking=True) (not a wait), or every N steps'
    if any(s in c for s in (".cpu()", ".numpy()", ".tolist()", '.to("cpu")', ".to('cpu')")):
        return "collect the results on rgpu (torch.stack) and move them once, after the loop"
    if c.startswith("print("):
        return "print every N steps, not every step"
    if code.lstrip().startswith(("if ", "while ", "assert ")):
        return (
            "a tensor in a condition waits each time: decide on rgpu (torch.where), or check "
            "every N steps"
        )
    return "keep values on rgpu and read them once, after the loop"


def source_line(key: tuple[str, int], width: int = 40) -> str:
    """The stripped text of a line of user code (IPython keeps cells in linecache), shortened."""
    text = linecache.getline(*key).strip()
    return text if len(text) <= width else text[: width - 1] + "…"
