"""Exceptions a user of rgpu can catch."""

from __future__ import annotations


class RgpuError(RuntimeError):
    """Base class of rgpu's own errors."""


class RemoteError(RgpuError):
    """An op failed on the server. Raised at the next wait, once; the session stays usable.

    `op` names the failed operator (e.g. "aten::mm.default"), `remote_message` is the server's
    exception text.
    """

    def __init__(self, op: str, remote_message: str) -> None:
        super().__init__(f"{op} failed on the rgpu server: {remote_message}")
        self.op = op
        self.remote_message = remote_message


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
