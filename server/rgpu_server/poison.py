"""What stands in for the outputs of a failed op."""

from __future__ import annotations


class Poison:
    """Stands in for the outputs of a failed op; every later use fails with the same error."""

    __slots__ = ("label", "message")

    def __init__(self, label: str, message: str) -> None:
        self.label = label
        self.message = message


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
