"""Every `RGPU_*` setting of the client, read from the environment in one place.

`Config.from_env()` reads them all when a session connects (`rgpu.connect`, or the first use of
the device); the session keeps that frozen config for its life, so changing the environment
affects the next connect. A value that does not parse is one `ConfigError` naming the variable
and what it accepts. `docs/configuration.md` is the table of them (a test keeps it in step with
`FIELDS`). Importing rgpu reads nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from .errors import RgpuError


class ConfigError(RgpuError, ValueError):
    """An RGPU_* environment variable holds a value rgpu does not understand."""


_TRUE = ("1", "on", "yes", "true")
_FALSE = ("0", "off", "no", "false", "")


def _flag(raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError("use 1 or 0")


def _int(raw: str) -> int:
    try:
        return int(raw.strip())
    except ValueError:
        raise ValueError("use a whole number") from None


def _count(raw: str) -> int:
    value = _int(raw)
    if value < 0:
        raise ValueError("use a whole number of at least 0")
    return value


def _positive(raw: str) -> int:
    value = _int(raw)
    if value < 1:
        raise ValueError("use a whole number of at least 1")
    return value


def _seconds(raw: str) -> float:
    try:
        value = float(raw.strip())
    except ValueError:
        raise ValueError("use a number of seconds") from None
    if not value >= 0:
        raise ValueError("use a number of seconds of at least 0")
    return value


def _text(raw: str) -> str | None:
    return raw.strip() or None


def _compress(raw: str) -> str:
    value = raw.strip().lower()
    if value in ("", "auto"):
        return "auto"
    if value in ("1", "on", "yes", "true", "always"):
        return "on"
    if value in ("0", "off", "no", "false", "never"):
        return "off"
    raise ValueError(
        "use auto (compress the op stream when the link is measured slow), 1 (always) or 0 (never)"
    )


@dataclass(frozen=True)
class Setting:
    env: str
    parse: Callable[[str], Any]
    doc: str


# field name -> its variable, parser and meaning; the order is the docs table's
FIELDS: dict[str, Setting] = {
    "server": Setting("RGPU_SERVER", _text, "server to connect to on first use: ws://, wss://, "
                      "host:port, ssh://... or local (an embedded server); several, separated "
                      "by commas, make one device list; unset: local"),
    "token": Setting("RGPU_TOKEN", _text, "the server's token (`rgpu.connect(token=...)` and a "
                     "?token= in the URL take precedence)"),
    "session": Setting("RGPU_SESSION", _text, "a session name: connect on first use to this "
                       "named session, which outlives the process (rgpu.keep / rgpu.kept)"),
    "local_device": Setting("RGPU_LOCAL_DEVICE", _text, "--device of an embedded server: auto, "
                            "cpu, cuda, cuda:N, mps"),
    "local_threads": Setting("RGPU_LOCAL_THREADS", _positive, "--threads of an embedded server: "
                             "threads each CPU kernel may use; unset: one per core but one, "
                             "left to this process"),
    "ca_bundle": Setting("RGPU_CA_BUNDLE", _text, "a CA certificate file trusted for wss:// "
                         "servers (a private CA)"),
    "proxy": Setting("RGPU_PROXY", _text, "an HTTP or SOCKS proxy for the websocket (the bulk lane "
                     "is not used through one)"),
    "ssh_command": Setting("RGPU_SSH_COMMAND", _text, "the ssh client (and options) for ssh:// "
                           "and slurm:// URLs"),
    "slurm_idle_seconds": Setting("RGPU_SLURM_IDLE_SECONDS", _seconds, "the rgpu-server of a "
                                  "slurm:// job stops, ending the job, after this long unused "
                                  "by its client (0: never; `idle=` in the URL wins)"),
    "slurm_warn_seconds": Setting("RGPU_SLURM_WARN_SECONDS", _seconds, "how long before a "
                                  "slurm:// job's time limit rgpu warns"),
    "allow_version_mismatch": Setting("RGPU_ALLOW_VERSION_MISMATCH", _flag, "1: connect even when "
                                      "the server's torch major.minor differs"),
    "flush_ops": Setting("RGPU_FLUSH_OPS", _positive, "queued messages that make a batch go out"),
    "flush_bytes": Setting("RGPU_FLUSH_BYTES", _positive, "queued bytes that make a batch go out"),
    "quiet_us": Setting("RGPU_QUIET_US", _positive, "microseconds without a new op after which "
                        "the queue goes out"),
    "replay_bytes": Setting("RGPU_REPLAY_BYTES", _positive, "unacknowledged bytes kept for a "
                            "resume before the client waits for the server (flow control)"),
    "reconnect_seconds": Setting("RGPU_RECONNECT_SECONDS", _seconds, "how long a dropped "
                                 "connection is retried before the session is lost"),
    "check_meta": Setting("RGPU_CHECK_META", _flag, "1 (debugging): send the predicted layout "
                          "of every op's outputs and have the server check it; a mismatch fails "
                          "the op and is never repaired"),
    "compress": Setting("RGPU_COMPRESS", _compress, "op-stream compression: auto (on slow "
                        "links), 1 or 0"),
    "lane": Setting("RGPU_LANE", _flag, "0: never open the bulk lane for large transfers"),
    "lane_min_bytes": Setting("RGPU_LANE_MIN_BYTES", _count, "smallest transfer that uses the "
                              "bulk lane"),
    "dedup": Setting("RGPU_DEDUP", _flag, "0: always upload, even bytes the server already "
                     "holds"),
    "dedup_min_bytes": Setting("RGPU_DEDUP_MIN_BYTES", _count, "smallest upload looked up by "
                               "content"),
    "progress_bytes": Setting("RGPU_PROGRESS_BYTES", _count, "transfers of at least this many "
                              "bytes show a progress bar (0: never)"),
    "replay": Setting("RGPU_REPLAY", _flag, "1: replayed steps (a repeated step sent once, then "
                      "one message per repetition); 0: every op as it is"),
    "generate_lookahead": Setting("RGPU_GENERATE_LOOKAHEAD", _count, "decode steps a Hugging "
                                  "Face generate() runs ahead of its stop check (0: one wait "
                                  "per token)"),
}  # fmt: skip


@dataclass(frozen=True)
class Config:
    server: str | None = None
    token: str | None = None
    session: str | None = None
    local_device: str | None = None  # None: auto
    local_threads: int | None = None  # None: one per core but one
    ca_bundle: str | None = None
    proxy: str | None = None
    ssh_command: str | None = None
    slurm_idle_seconds: float = 3600.0
    slurm_warn_seconds: float = 600.0
    allow_version_mismatch: bool = False
    flush_ops: int = 128
    flush_bytes: int = 1 << 20
    quiet_us: int = 2000
    replay_bytes: int = 256 << 20
    reconnect_seconds: float = 60.0
    check_meta: bool = False
    compress: str = "auto"
    lane: bool = True
    lane_min_bytes: int = 4 << 20
    dedup: bool = True
    dedup_min_bytes: int = 4096
    progress_bytes: int = 64 << 20
    replay: bool = False  # off until it saves CPU as well as messages (BENCHMARKS.md, replay)
    generate_lookahead: int = 8

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Config:
        """The settings in `environ` (os.environ by default); unset ones keep their defaults."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name, setting in FIELDS.items():
            raw = env.get(setting.env)
            if raw is None:
                continue
            try:
                values[name] = setting.parse(raw)
            except ValueError as e:
                raise ConfigError(
                    f"{setting.env}={raw!r} is not understood: {e} ({setting.doc})"
                ) from None
        return cls(**values)

    def describe(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "token"}


DEFAULT = Config()


def table() -> str:
    """The settings as the Markdown table docs/configuration.md holds."""
    rows = ["| variable | default | meaning |", "| --- | --- | --- |"]
    for name, setting in FIELDS.items():
        default = getattr(DEFAULT, name)
        shown = "unset" if default is None else f"`{_shown(default)}`"
        rows.append(f"| `{setting.env}` | {shown} | {setting.doc} |")
    return "\n".join(rows) + "\n"


def _shown(value: Any) -> str:
    if value is True or value is False:
        return "1" if value else "0"
    if isinstance(value, int) and value >= 1 << 20 and value % (1 << 20) == 0:
        return f"{value >> 20} MiB"
    return str(value)
