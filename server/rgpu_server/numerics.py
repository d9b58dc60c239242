"""A session's numeric settings (SETTINGS): deterministic algorithms, float32 matmul precision
(TF32), cuDNN's and oneDNN's flags.

torch keeps them per process, and a server runs several sessions' workers in one process, so
each session's settings are put in force when its worker takes a frame and another session's
were in force (a comparison when nothing changes). Sessions whose frames run at the same moment
with different settings share the process's flags: the last to start a frame sets them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from rgpu_protocol import SETTING_NAMES

from .poison import describe

Settings = tuple  # ((name, value), ...) in the order the client set them


def _set_deterministic(value: Any) -> None:
    mode, warn_only = value
    torch.use_deterministic_algorithms(bool(mode), warn_only=bool(warn_only))


def _get_deterministic() -> list:
    return [torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled()]  # fmt: skip


def _set_fill(value: Any) -> None:
    torch.utils.deterministic.fill_uninitialized_memory = bool(value)  # type: ignore[attr-defined]


def _owner_and_attr(name: str) -> tuple[Any, str]:
    path, _, attr = name.rpartition(".")
    owner: Any = torch
    for part in path.split("."):
        owner = getattr(owner, part)
    return owner, attr


def _set_attr(name: str) -> Callable[[Any], None]:
    def set_(value: Any) -> None:
        owner, attr = _owner_and_attr(name)
        setattr(owner, attr, tuple(value) if isinstance(value, list) else value)

    return set_


def _get_attr(name: str) -> Callable[[], Any]:
    def get() -> Any:
        owner, attr = _owner_and_attr(name)
        return getattr(owner, attr)

    return get


SETTERS: dict[str, Callable[[Any], None]] = {
    "deterministic": _set_deterministic,
    "fill_uninitialized_memory": _set_fill,
    "float32_matmul_precision": torch.set_float32_matmul_precision,
}
GETTERS: dict[str, Callable[[], Any]] = {
    "deterministic": _get_deterministic,
    "fill_uninitialized_memory": lambda: torch.utils.deterministic.fill_uninitialized_memory,  # type: ignore[attr-defined]
    "float32_matmul_precision": torch.get_float32_matmul_precision,
}
for _name in SETTING_NAMES:
    if _name.startswith("backends."):
        SETTERS[_name], GETTERS[_name] = _set_attr(_name), _get_attr(_name)


def _read_defaults() -> dict[str, Any]:
    """The process's settings before any session changed them (what a session that set none
    runs with). One this torch lacks is left out: setting it fails for the session that asks."""
    found = {}
    for name in SETTING_NAMES:
        try:
            found[name] = GETTERS[name]()
        except (AttributeError, RuntimeError):
            pass
    return found


DEFAULTS = _read_defaults()
_lock = threading.Lock()
_applied: Settings = ()  # the settings in force in this process now


def _apply(settings: Settings, fail: Callable[[str, str], None] | None) -> None:
    """Put `settings` in force in place of `_applied` (the lock held): the names the old ones set
    go back to their defaults first, then the new ones are set in order."""
    global _applied
    for name in dict(_applied):
        if name in DEFAULTS:
            try:
                SETTERS[name](DEFAULTS[name])
            except Exception:  # back to a state torch refuses: the new ones below still apply
                pass
    for name, value in settings:
        try:
            SETTERS[name](value)
        except Exception as e:
            if fail is not None:
                fail(name, describe(e))
    _applied = settings


def enter(s: Any) -> None:
    """Before `s` runs a frame: its settings in force (cheap when they already are)."""
    global _applied
    if s.settings is not _applied:
        with _lock:
            if s.settings != _applied:
                _apply(s.settings, None)  # failures were reported when they were set
            _applied = s.settings


def settings(s: Any, seq: int, msg: list) -> None:
    """SETTINGS [[name, value], ...]: the client's settings from here on."""
    pairs = []
    for item in msg[1]:
        if not (isinstance(item, list) and len(item) == 2 and type(item[0]) is str
                and item[0] in SETTERS):  # fmt: skip
            s.fail("settings", f"unknown numeric setting {item!r}: this server knows "
                   f"{', '.join(SETTING_NAMES)}", ())  # fmt: skip
            continue
        pairs.append((item[0], item[1]))
    s.settings = tuple(pairs)

    def fail(name: str, why: str) -> None:
        s.fail("settings", f"the server could not set {name}: {why}", ())

    with _lock:
        _apply(s.settings, fail)
