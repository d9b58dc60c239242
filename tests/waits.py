"""Acting at a chosen point of a wait, instead of after a guessed delay."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class DuringNextWait:
    """Run `action` from another thread `after` seconds into the session's next wait.

    `session.request` is wrapped on the instance: the action starts only once the user's thread
    has queued the waited message and is about to block on its reply. `join()` returns once the
    action ran (or raises if it never did)."""

    def __init__(self, session, action: Callable[[], None], after: float = 0.1) -> None:
        self.session = session
        self.entered = threading.Event()
        self.done = threading.Event()
        real = session.request

        def request(*args, **kwargs):
            session.__dict__.pop("request", None)  # only the next wait
            self.entered.set()
            return real(*args, **kwargs)

        def act() -> None:
            if self.entered.wait(60):
                time.sleep(after)
                action()
                self.done.set()

        session.request = request
        self._thread = threading.Thread(target=act, daemon=True)
        self._thread.start()

    def join(self, timeout: float = 60) -> None:
        self._thread.join(timeout)
        self.session.__dict__.pop("request", None)
        assert self.done.is_set(), "the session never waited, so the action never ran"
