"""Per-cell accounting: what each notebook cell cost the remote device.

IPython's `pre_run_cell` / `post_run_cell` events bracket every (non-silent) cell. A snapshot of
`rgpu.stats()` at each end gives the cell's messages, waits and bytes. Cells are keyed by the
frontend's `cell_id` (JupyterLab sends one; re-running a cell replaces its row) and, when there is
none (nbclient, nbval, a terminal), by a counter. Never by `execution_count`: nbval executes with
`store_history=False`, which leaves it the same for every cell. The number shown, `[7]`, is the
execution count where the cell has one (as the notebook's prompt shows it), else the counter.
Cells of `%rgpu` lines only (connect, status, ...) are not recorded: they are not the user's work.

The hooks never print and never raise: IPython prints a hook's traceback into the cell's output,
which would corrupt every cell (and every nbval comparison) after one bug.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import rgpu

log = logging.getLogger("rgpu_jupyter")

COUNTERS = (
    "messages",
    "waits",
    "bytes_out",
    "bytes_in",
    "frames",
    "wait_seconds",
    "dedup_hits",
    "dedup_bytes_saved",
)
_ZERO: dict[str, float] = {k: 0 for k in COUNTERS}


@dataclass
class CellCost:
    """One cell's counters (a difference of two `rgpu.stats()` snapshots) and its wall time."""

    key: str
    label: str
    number: int  # order of execution since the extension was loaded (1, 2, ...)
    messages: int = 0
    waits: int = 0
    bytes_out: int = 0
    bytes_in: int = 0
    frames: int = 0
    wait_seconds: float = 0.0
    wall_seconds: float = 0.0
    success: bool = True
    dedup_hits: int = 0  # uploads of data the server already had (sent as a reference)
    dedup_bytes_saved: int = 0
    busiest: tuple[str, int] | None = None  # the user's line that waited most: (file, line)
    busiest_waits: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def touched_rgpu(self) -> bool:
        return bool(self.messages or self.waits or self.bytes_out or self.bytes_in)

    def as_dict(self) -> dict[str, Any]:
        return {
            "cell": self.number,
            "label": self.label,
            "messages": self.messages,
            "waits": self.waits,
            "bytes_out": self.bytes_out,
            "bytes_in": self.bytes_in,
            "wait_seconds": self.wait_seconds,
            "wall_seconds": self.wall_seconds,
        }


def cell_label(source: str, width: int = 32) -> str:
    """The first line of code that says what a cell does (cell magics and comments skipped)."""
    for line in source.splitlines():
        s = line.strip()
        if not s or s.startswith("#") or s.startswith("%%"):
            continue
        return s if len(s) <= width else s[: width - 1] + "…"
    return ""


_OWN_LINES = ("%rgpu", "%load_ext rgpu_jupyter", "%reload_ext rgpu_jupyter")


def only_rgpu_magics(source: str) -> bool:
    """A cell of `%rgpu ...` lines only (and loading the extension): not counted as a cell."""
    lines = [s.strip() for s in source.splitlines()]
    lines = [s for s in lines if s and not s.startswith("#")]
    return bool(lines) and all(
        any(s == own or s.startswith(own + " ") for own in _OWN_LINES) for s in lines
    )


class Snapshot:
    """Counters of the current session at one moment, tied to that session.

    A new session starts its counters at zero, so a difference across a reconnect would go
    negative; `since` then counts from the new session's start instead.
    """

    __slots__ = ("session", "values", "waits_at")

    def __init__(
        self,
        session: object,
        values: dict[str, float],
        waits_at: dict[tuple[str, int], int] | None = None,
    ) -> None:
        self.session = session
        self.values = values
        self.waits_at = waits_at or {}  # waits so far per user line (rgpu.settings.op_sites)

    def since(self, start: Snapshot) -> dict[str, float]:
        base = start.values if start.session is self.session else _ZERO
        return {k: self.values.get(k, 0) - base.get(k, 0) for k in COUNTERS}

    def busiest_since(self, start: Snapshot) -> tuple[tuple[str, int] | None, int]:
        """The user's line that waited most since `start`, and how many times."""
        base = start.waits_at if start.session is self.session else {}
        best, most = None, 0
        for key, n in self.waits_at.items():
            n -= base.get(key, 0)
            if n > most:
                best, most = key, n
        return best, most


def _rgpu_snapshot() -> Snapshot:
    session = rgpu.current_session()
    sites = getattr(session, "sites", None)
    return Snapshot(session, rgpu.stats(), dict(sites.waits) if sites is not None else None)


def send_leftovers() -> None:
    """Send what earlier cells left queued (ops, and frees of their garbage) before a cell starts.

    Not a wait. Without it those messages would go out with the next cell's first batch and be
    counted as that cell's cost, by luck of timing.
    """
    session = rgpu.current_session()
    if session is not None and session.state == "connected":
        session.flush()


@dataclass
class _Running:
    """The cell being run: its pre_run_cell info (None for the provisional record of a load)."""

    info: Any
    key: str
    label: str
    number: int
    start: Snapshot
    t0: float
    counted: bool = True  # False for a cell of %rgpu lines only


class CellAccounting:
    """Records every cell's cost from IPython's run-cell events; keeps the most recent ones.

    `snapshot` is where the counters come from (`rgpu.stats()` of the current session by default;
    tests pass a fake); `settle` runs before a cell's first snapshot (by default it sends what
    earlier cells left queued). Safe to read from another thread (the widget's timer).
    """

    def __init__(
        self,
        snapshot: Callable[[], Snapshot] = _rgpu_snapshot,
        keep: int = 20,
        settle: Callable[[], None] | None = send_leftovers,
    ) -> None:
        self.snapshot = snapshot
        self.settle = settle
        self.keep = keep
        self.history: OrderedDict[str, CellCost] = OrderedDict()
        self.version = 0  # bumped whenever history changes, so watchers can skip re-rendering
        self.errors = 0  # exceptions swallowed by the hooks (inspect these when debugging)
        self._counter = 0
        self._running: _Running | None = None
        self._lock = threading.Lock()
        self._shell: Any = None

    # -- IPython events ----------------------------------------------------------------------

    def register(self, shell: Any) -> None:
        """Attach to `shell`'s events, replacing any accounting an earlier load left behind."""
        for event in ("pre_run_cell", "post_run_cell"):
            for cb in list(shell.events.callbacks.get(event, [])):
                if type(getattr(cb, "__self__", None)).__name__ == type(self).__name__:
                    shell.events.unregister(event, cb)
        shell.events.register("pre_run_cell", self.pre_run_cell)
        shell.events.register("post_run_cell", self.post_run_cell)
        self._shell = shell

    def unregister(self) -> None:
        shell, self._shell = self._shell, None
        if shell is None:
            return
        for event, cb in (
            ("pre_run_cell", self.pre_run_cell),
            ("post_run_cell", self.post_run_cell),
        ):
            try:
                shell.events.unregister(event, cb)
            except ValueError:
                pass

    def _number(self, info: Any) -> int:
        """The number a person knows the cell by: its prompt's execution count where IPython
        keeps one for it (not under nbval, which runs cells with store_history=False)."""
        count = getattr(self._shell, "execution_count", None)
        if getattr(info, "store_history", False) and type(count) is int:
            return count
        return self._counter

    def begin_now(self) -> None:
        """Count from now as part of whichever cell ends next.

        The extension is usually loaded by `%load_ext` in a cell that then goes on to connect
        and compute; that cell's pre_run_cell fired before the hooks existed. Loaded at start-up
        (before any cell), the next cell's pre_run_cell replaces this provisional record.
        """
        try:
            self._counter += 1  # (the cell's own number is known when it ends)
            self._running = _Running(
                None, "", "", self._counter, self.snapshot(), time.perf_counter()
            )
        except Exception:
            self.errors += 1
            log.debug("rgpu_jupyter: begin_now failed", exc_info=True)

    def pre_run_cell(self, info: Any = None) -> None:
        try:
            running = self._running
            if running is not None and running.info is not None:
                return  # a nested run_cell (%%capture, %run -i ...) belongs to the outer cell
            if running is not None:  # provisional, from a load before any cell
                self._counter -= 1
            self._counter += 1
            cell_id = getattr(info, "cell_id", None)
            key = str(cell_id) if cell_id else f"#{self._counter}"
            source = getattr(info, "raw_cell", "") or ""
            if self.settle is not None:
                self.settle()
            start = self.snapshot()
            self._running = _Running(
                info, key, cell_label(source), self._number(info), start, time.perf_counter(),
                not only_rgpu_magics(source),
            )  # fmt: skip
        except Exception:  # a hook must never disturb the user's cell
            self.errors += 1
            log.debug("rgpu_jupyter: pre_run_cell failed", exc_info=True)

    def post_run_cell(self, result: Any = None) -> None:
        try:
            running = self._running
            info = getattr(result, "info", None)
            # IPython fires post_run_cell without pre_run_cell for an empty cell, nested or not:
            # finish only the cell we started (result is None when run_cell itself failed; the
            # started info is None when the extension was loaded inside the cell now ending)
            if running is None:
                return
            if result is not None and running.info is not None and info is not running.info:
                return
            cost = self._finish(getattr(result, "success", True))
            counted = running.counted
            if running.info is None and info is not None:
                cell_id = getattr(info, "cell_id", None)
                cost.key = str(cell_id) if cell_id else f"#{cost.number}"
                source = getattr(info, "raw_cell", "") or ""
                cost.label = cell_label(source)
                counted = not only_rgpu_magics(source)
                count = getattr(result, "execution_count", None)
                if getattr(info, "store_history", False) and type(count) is int:
                    cost.number = count
            if cost.touched_rgpu and counted:
                with self._lock:
                    self.history.pop(cost.key, None)
                    self.history[cost.key] = cost
                    while len(self.history) > max(1, self.keep):
                        self.history.popitem(last=False)
                    self.version += 1
        except Exception:
            self.errors += 1
            log.debug("rgpu_jupyter: post_run_cell failed", exc_info=True)

    # -- reading -----------------------------------------------------------------------------

    def _finish(self, success: bool) -> CellCost:
        running = self._running
        assert running is not None
        self._running = None
        return running_cost(running, self.snapshot(), success)

    def live(self) -> CellCost | None:
        """The running cell's cost so far, or None between cells (called from the widget's timer)."""
        running = self._running
        if running is None:
            return None
        return running_cost(running, self.snapshot(), True)

    def recent(self, n: int | None = None) -> list[CellCost]:
        """The last `n` recorded cells (all kept ones by default), oldest first."""
        with self._lock:
            rows = list(self.history.values())
        return rows if n is None else rows[-n:] if n > 0 else []

    def clear(self) -> None:
        with self._lock:
            self.history.clear()
            self.version += 1


def running_cost(running: _Running, end: Snapshot, success: bool) -> CellCost:
    cost = make_cost(
        running.key,
        running.label,
        running.number,
        end.since(running.start),
        time.perf_counter() - running.t0,
        success,
    )
    cost.busiest, cost.busiest_waits = end.busiest_since(running.start)
    return cost


def make_cost(
    key: str, label: str, number: int, d: dict[str, float], wall: float, success: bool
) -> CellCost:
    """A `CellCost` from a counter difference (`Snapshot.since`)."""
    return CellCost(
        key=key,
        label=label,
        number=number,
        messages=int(d["messages"]),
        waits=int(d["waits"]),
        bytes_out=int(d["bytes_out"]),
        bytes_in=int(d["bytes_in"]),
        frames=int(d["frames"]),
        wait_seconds=float(d["wait_seconds"]),
        wall_seconds=wall,
        success=success,
        dedup_hits=int(d.get("dedup_hits", 0)),
        dedup_bytes_saved=int(d.get("dedup_bytes_saved", 0)),
    )
