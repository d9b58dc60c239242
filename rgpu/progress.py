"""Progress bars for long transfers (tqdm.auto: a widget in notebooks, text in terminals)."""

from __future__ import annotations

import os
from typing import Any


class Settings:
    """User-tunable client behaviour (also set by `%config RgpuMagics...` in Jupyter)."""

    def __init__(self) -> None:
        # transfers of at least this many bytes show a progress bar with rate and ETA
        try:
            self.progress_bytes = int(os.environ.get("RGPU_PROGRESS_BYTES", 64 << 20))
        except ValueError:  # importing rgpu must never raise
            self.progress_bytes = 64 << 20


settings = Settings()


class TransferProgress:
    """A byte-counting bar shown only for transfers of at least `settings.progress_bytes`."""

    def __init__(self, total: int, desc: str) -> None:
        self._bar: Any = None
        self._shown = 0
        if total >= settings.progress_bytes > 0:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                return
            self._bar = tqdm(
                total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False
            )

    def update_to(self, done: int) -> None:
        if self._bar is not None and done > self._shown:
            self._bar.update(done - self._shown)
            self._shown = done

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
