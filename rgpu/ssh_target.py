"""`ssh://` URLs: what they name, the options they take, and the errors reaching a host can give."""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from .errors import ConnectError

DEFAULT_PORT = 9720
STARTS = ("auto", "yes", "no")


class SshError(ConnectError):
    """`ssh` to the GPU host failed (the message carries what ssh said and what to do)."""


class SshUnreachable(SshError):
    """The GPU host could not be reached: unknown name, refused or timed-out connection."""


class SshAuthError(SshError):
    """The host refused the SSH login (no usable key: rgpu's ssh never prompts)."""


class ServerMissing(SshError):
    """No `rgpu-server` could be started on the host (it is not installed, or not on PATH)."""


@dataclass
class SshTarget:
    """Where and how to reach the server: parsed from an ``ssh://`` URL plus keyword options."""

    destination: str  # "user@host" or a Host alias of ~/.ssh/config
    ssh_port: int | None = None
    port: int = DEFAULT_PORT  # the rgpu server's port on the host's loopback address
    identity: str | None = None
    start: str = "auto"  # auto: use a server on `port`, else start one; yes: always; no: never
    device: str | None = None  # --device of a server started here
    server_command: str | None = None  # remote command line that runs rgpu-server
    # on the host, for a server already running there: default .config/rgpu/token-PORT
    token_file: str | None = None
    # the local ssh client and its options: default RGPU_SSH_COMMAND, else "ssh"
    ssh_command: str | None = None
    token: str | None = field(default=None, repr=False)
    # reach this host through another one (a login node): its own port, key and options apply
    # to that hop (ssh's ProxyJump would drop -i and the timeouts); ?jump=[user@]host[:port]
    jump: SshTarget | None = None

    @property
    def host(self) -> str:
        return self.destination.rpartition("@")[2]


_OPTIONS = {f.name for f in fields(SshTarget)} - {"destination"}


def split_netloc(netloc: str, url: str, scheme: str = "ssh") -> tuple[str, str]:
    """``[user@]host[:port]`` as ("user@host" or "host", port text); refuses what ssh would
    misread as an option or what a shell would split."""
    user, at, hostport = netloc.rpartition("@")
    if hostport.startswith("["):  # [ipv6]:port
        host, _, rest = hostport[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    else:
        host, _, port_text = hostport.partition(":")
    user, host = urllib.parse.unquote(user), urllib.parse.unquote(host)
    if (
        not host
        or host.startswith("-")
        or user.startswith("-")
        or any(c in netloc for c in " \t\n'\"\\")
    ):
        raise ConnectError(
            f"{url!r} does not name an SSH host (expected {scheme}://user@host[:port])"
        )
    return (f"{user}@{host}" if at else host), port_text


def parse_port(key: str, value: Any, url: str) -> int:
    try:
        port = int(value)
    except (TypeError, ValueError):
        raise ConnectError(f"{key} must be a number, not {value!r} ({url})") from None
    if not 0 < port < 65536:
        raise ConnectError(f"{key} {port} is not a TCP port ({url})")
    return port


def parse_ssh_url(url: str, options: Mapping[str, Any] | None = None) -> SshTarget:
    """``ssh://[user@]host[:sshport][?port=9720&identity=PATH&start=auto|yes|no&...]`` and keyword
    options (which win over the URL's query) as an `SshTarget`; refuses what ssh would misread."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme.lower() != "ssh":
        raise ConnectError(f"not an ssh:// URL: {url}")
    destination, port_text = split_netloc(parts.netloc, url)
    values: dict[str, Any] = {}
    if port_text:
        values["ssh_port"] = port_text
    for key, value in urllib.parse.parse_qsl(parts.query, keep_blank_values=True):
        values[key] = value
    values.update({k: v for k, v in (options or {}).items() if v is not None})
    unknown = sorted(set(values) - _OPTIONS)
    if unknown:
        raise ConnectError(
            f"unknown ssh option(s) {', '.join(unknown)} for {url}; known: {', '.join(sorted(_OPTIONS))}"
        )
    target = SshTarget(destination=destination)
    for key in ("ssh_port", "port"):
        if key in values:
            values[key] = parse_port(key, values[key], url)
    start = str(values.get("start", "auto")).lower()
    if start not in STARTS:
        raise ConnectError(f"start must be one of {', '.join(STARTS)}, not {start!r} ({url})")
    values["start"] = start
    if values.get("identity"):
        values["identity"] = os.path.expanduser(str(values["identity"]))
    if isinstance(values.get("jump"), str):  # the hop shares the key and the ssh client
        hop, hop_port = split_netloc(values["jump"], url)
        values["jump"] = SshTarget(
            destination=hop,
            ssh_port=parse_port("jump port", hop_port, url) if hop_port else None,
            identity=values.get("identity"),
            ssh_command=values.get("ssh_command"),
        )
    return replace(target, **values)
