"""Progress bars for long transfers (tqdm.auto: a widget in notebooks, text in terminals), and
the transfers in flight, which a live view (the Jupyter widget) reads from another thread."""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any

from .config import DEFAULT, Config


class Settings:
    """User-tunable client behaviour (also set by `%config RgpuMagics...` in Jupyter).

    `progress_bytes`: transfers of at least this many bytes show a progress bar with rate and
    ETA; until set here, the session's RGPU_PROGRESS_BYTES (64 MiB by default) decides."""

    def __init__(self) -> None:
        self._progress_bytes: int | None = None
        self._generate_lookahead: int | None = None
        self._op_sites = False
        self._replay: bool | None = None
        self._sessions: weakref.WeakSet = weakref.WeakSet()

    @property
    def op_sites(self) -> bool:
        """Record where each op is queued, so a failure reported at a later wait names the
        line (in a notebook, the cell) that queued it. A few stack frames per op; the Jupyter
        extension turns it on."""
        return self._op_sites

    @op_sites.setter
    def op_sites(self, value: bool) -> None:
        self._op_sites = bool(value)
        for session in list(self._sessions):
            session.record_sites = self._op_sites

    def watch(self, session: Any) -> None:
        """A session that reads these settings on its hot path: it hears of changes."""
        self._sessions.add(session)
        session.record_sites = self._op_sites
        if self._replay is not None:
            session.replay.set_enabled(self._replay)

    @property
    def replay(self) -> bool | None:
        """Replayed steps (rgpu.replay): a repeated op sequence goes to the server once, then one
        message per repetition. False sends every op as it is. Until set here (None), each
        session's RGPU_REPLAY decides (off by default)."""
        return self._replay

    @replay.setter
    def replay(self, value: bool | None) -> None:
        self._replay = None if value is None else bool(value)
        for session in list(self._sessions):
            session.replay.set_enabled(
                session.config.replay if self._replay is None else self._replay
            )

    @property
    def progress_bytes(self) -> int:
        return self._progress_bytes if self._progress_bytes is not None else _session_default[0]

    @progress_bytes.setter
    def progress_bytes(self, value: int) -> None:
        self._progress_bytes = int(value)

    @property
    def generate_lookahead(self) -> int:
        """How many decode steps a Hugging Face `generate()` on rgpu may run before it waits for
        the answer to "has every sequence finished?" (rgpu.generation); 0: wait every token.
        Until set here, the session's RGPU_GENERATE_LOOKAHEAD (8) decides."""
        if self._generate_lookahead is not None:
            return self._generate_lookahead
        return _session_default[1]

    @generate_lookahead.setter
    def generate_lookahead(self, value: int) -> None:
        if int(value) < 0:
            raise ValueError(f"generate_lookahead must be 0 or more, not {value}")
        self._generate_lookahead = int(value)


# the current session's RGPU_PROGRESS_BYTES and RGPU_GENERATE_LOOKAHEAD
_session_default = [DEFAULT.progress_bytes, DEFAULT.generate_lookahead]


def use_config(config: Config) -> None:
    """A session with this config became the current one."""
    _session_default[:] = [config.progress_bytes, config.generate_lookahead]


settings = Settings()


_active: dict[int, TransferProgress] = {}  # transfers in flight, by id()
_active_lock = threading.Lock()


def active_transfers() -> list[tuple[str, int, int, float]]:
    """The transfers in flight now, oldest first: (what, bytes done, bytes in all, seconds
    since it started). Safe from any thread."""
    now = time.perf_counter()
    with _active_lock:
        return [(t.desc, t.done, t.total, now - t.started) for t in _active.values()]


class TransferProgress:
    """A transfer in flight: listed by `active_transfers`, and a byte-counting bar for transfers
    of at least `settings.progress_bytes`.

    `close` ends both, also when the transfer failed or its last update never came: the bar then
    disappears rather than stay behind frozen (tqdm's notebook bar keeps a bar closed short of
    its total, in red)."""

    def __init__(self, total: int, desc: str) -> None:
        self._bar: Any = None
        self._shown = 0
        self.total = total
        self.desc = desc
        self.done = 0
        self.started = time.perf_counter()
        if total > 0:
            with _active_lock:
                _active[id(self)] = self
        if total >= settings.progress_bytes > 0:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                return
            self._bar = tqdm(
                total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False
            )

    def update_to(self, done: int) -> None:
        self.done = max(self.done, done)
        if self._bar is not None and done > self._shown:
            self._bar.update(done - self._shown)
            self._shown = done

    def close(self) -> None:
        with _active_lock:
            _active.pop(id(self), None)
        bar, self._bar = self._bar, None
        if bar is not None:
            if bar.total and bar.n < bar.total:
                bar.n = bar.total  # closed short of its total: hidden, not left in red
            bar.close()
