"""A session's numeric settings (SETTINGS): deterministic algorithms, float32 matmul precision
(TF32), cuDNN's and oneDNN's flags.

torch keeps them per process, and a server runs several sessions' workers in one process, so
frames pass a gate: frames of sessions whose settings are equal (most often, all the defaults)
run together; a frame whose settings differ waits until those running end, then puts its own in
force, and frames arriving meanwhile wait behind it. One user's TF32 or deterministic mode never
reaches another user's kernels. A frame lets the gate go while it waits on something outside
itself (other ranks in a collective, a slow client taking a reply), so no session holds up the
others by waiting, and ranks with different settings cannot deadlock in a collective.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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
_gate = threading.Condition()
_applied: Settings = ()  # the settings in force in this process now
_running = 0  # frames running now, all under `_applied`
_waiting = 0  # frames waiting for the running ones to end
_holder = threading.local()  # .session: the session whose frame this thread runs in the gate


def _apply(settings: Settings, fail: Callable[[str, str], None] | None) -> None:
    """Put `settings` in force in place of `_applied` (the gate held, no frame running): the
    names the old ones set go back to their defaults first, then the new ones are set in order."""
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


def enter(s: Any, fail: Callable[[str, str], None] | None = None) -> None:
    """Before `s` runs a frame: wait for its turn, then its settings in force. `fail`: report
    each setting torch refuses (they are applied again even when already in force)."""
    global _running, _waiting
    with _gate:
        if _running and (_waiting or s.settings != _applied):
            _waiting += 1
            while _running:
                _gate.wait()
            _waiting -= 1
        if fail is not None or s.settings != _applied:
            _apply(s.settings, fail)
        _running += 1
    _holder.session = s


def leave() -> None:
    """After the frame `enter` let in (a no-op when this thread holds no place)."""
    global _running
    if getattr(_holder, "session", None) is None:
        return
    _holder.session = None
    with _gate:
        _running -= 1
        if not _running:
            _gate.notify_all()


@contextmanager
def released() -> Iterator[None]:
    """Around a wait on something outside the frame: others may run (and set their settings)
    meanwhile; the frame's own are in force again after."""
    s = getattr(_holder, "session", None)
    if s is None:
        yield
        return
    leave()
    try:
        yield
    finally:
        enter(s)


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

    leave()  # sessions running under the old settings end their frames first
    enter(s, fail)
