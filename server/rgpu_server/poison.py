"""What stands in for the outputs of a failed op."""

from __future__ import annotations


class Poison:
    """Stands in for the outputs of a failed op; every later use fails with the same error."""

    __slots__ = ("label", "message", "seq")

    def __init__(self, label: str, message: str, seq: int = 0) -> None:
        self.label = label
        self.message = message
        self.seq = seq  # the message that failed: the client names the line that queued it


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
