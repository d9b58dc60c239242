"""Exceptions a user of rgpu can catch."""

from __future__ import annotations

import sys
import traceback
import types

# in a notebook with the extension loaded, hints name the magic where one fits
_NOTEBOOK_HINTS = (
    ("Call rgpu.connect()", "Run %rgpu connect"),
    ("call rgpu.connect()", "run %rgpu connect"),
    (
        "connect again with rgpu.connect() (%rgpu connect in a notebook)",
        "connect again with %rgpu connect",
    ),
    ("(rgpu.disconnect())", "(%rgpu disconnect)"),
    ("call rgpu.connect(url)", "run %rgpu connect URL"),
    ("rgpu.connect(url, session=...)", "%rgpu connect URL --session NAME"),
    ("rgpu.connect(url, token=...)", "%rgpu connect URL --token TOKEN"),
    ("rgpu.connect('local')", "%rgpu connect local"),
)


def magics_available() -> bool:
    """Running in IPython with the `%rgpu` magic loaded (the rgpu_jupyter extension)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    try:
        return shell is not None and shell.find_line_magic("rgpu") is not None
    except Exception:
        return False


def hint(text: str) -> str:
    """`text` with its hints in the form the user types: `%rgpu connect URL` where the magic is
    loaded, Python (`rgpu.connect(url)`) in scripts."""
    if not magics_available():
        return text
    for python, magic in _NOTEBOOK_HINTS:
        text = text.replace(python, magic)
    return text


def render_traceback(exc: BaseException) -> list[str]:
    """How IPython shows an error rgpu raises: the user's frames only (those of rgpu, torch,
    IPython and the standard library are hidden), cells named as the notebook shows them, and
    hints in the magics' syntax."""
    from . import sites

    frames = traceback.extract_tb(exc.__traceback__)
    shown = [f for f in frames if not sites.in_library(f.filename)]
    lines = ["Traceback (most recent call last):"]
    for f in shown:
        where = (sites.name_file(f.filename) if sites.name_file is not None else None) or (
            f'File "{f.filename}"'
        )
        lines.append(
            f"  {where}, line {f.lineno}" + (f", in {f.name}" if f.name != "<module>" else "")
        )
        if f.line:
            lines.append(f"    {f.line.strip()}")
    hidden = len(frames) - len(shown)
    if hidden:
        lines.append(f"  [{hidden} frame(s) inside rgpu, torch and Python hidden]")
    text = hint("".join(traceback.format_exception_only(type(exc), exc)).rstrip("\n"))
    return lines + text.splitlines()  # (its notes included)


def shown_briefly(exc: BaseException) -> BaseException:
    """`exc` (any type) shown by IPython as rgpu's own errors are."""
    exc._render_traceback_ = types.MethodType(render_traceback, exc)  # type: ignore[attr-defined]
    return exc


class RgpuError(RuntimeError):
    """Base class of rgpu's own errors."""

    def _render_traceback_(self) -> list[str]:
        return render_traceback(self)


class RemoteError(RgpuError):
    """An op failed on the server. Raised at the next wait, once; the session stays usable.

    `op` names the failed operator (e.g. "aten::mm.default"), `remote_message` is the server's
    exception text.
    """

    def __init__(
        self, op: str, remote_message: str, seq: int | None = None, site: str | None = None
    ) -> None:
        where = f" (queued at {site})" if site else ""
        super().__init__(f"{op} failed on the rgpu server{where}: {remote_message}")
        self.op = op
        self.remote_message = remote_message
        self.seq = seq  # the message that failed
        self.site = site  # where it was queued, when rgpu.settings.op_sites is on


class ConnectError(RgpuError, ConnectionError):
    """The server could not be reached, or refused the handshake."""


class AuthError(ConnectError):
    """The server rejected the token (or none was given)."""


class ConnectionLost(RgpuError, ConnectionError):
    """The link to the server dropped; queued work and waits on it did not complete."""


class SessionLost(RgpuError):
    """The server no longer has this session (it restarted, or the session expired).

    Every rgpu tensor of that session is gone. Connect again (`rgpu.connect()`) and recreate them.
    """


class ProtocolViolation(RgpuError):
    """The server said it could not understand what this client sent (a bug; please report it)."""


class SessionInUse(ConnectError):
    """The named session is held by another live client (connect with takeover=True to take it)."""


class NoSuchDevice(RgpuError, ValueError):
    """A device index past the connected servers' devices (`rgpu:7` with 4 devices): raised on
    the line that names it. A RuntimeError, as CUDA's invalid device ordinal is, and a
    ValueError, as a bad argument is."""
