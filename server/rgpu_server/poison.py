"""What stands in for the outputs of a failed op."""

from __future__ import annotations


class Poison:
    """Stands in for the outputs of a failed op; every later use fails with the same error."""

    __slots__ = ("label", "message", "seq", "index")

    def __init__(self, label: str, message: str, seq: int = 0, index: int | None = None) -> None:
        self.label = label
        self.message = message
        self.seq = seq  # the message that failed: the client names the line that queued it
        self.index = index  # which op of that REPLAY failed (None: not in a replayed sequence)

    def reply(self) -> list:
        """The value of an ERROR reply reporting this failure."""
        if self.index is None:
            return [self.label, self.message, self.seq]
        return [self.label, self.message, self.seq, self.index]


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
