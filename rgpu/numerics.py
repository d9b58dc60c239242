"""torch's numeric settings, followed on the server: `torch.use_deterministic_algorithms`,
`torch.utils.deterministic.fill_uninitialized_memory`, `torch.set_float32_matmul_precision`
(TF32), and the flags of `torch.backends.cuda.matmul`, `.cudnn` and `.mkldnn`.

torch keeps them per process, so the user's calls would change only the laptop's torch, and a
GPU host would go on without TF32 or determinism, with no error. Their setters are wrapped here:
each change goes to every connected server as a SETTINGS message, in order with the ops around
it (docs/protocol.md), and a session opened later gets the changes made before it. The names
and values are those of rgpu_protocol.SETTING_NAMES.

Not followed: the context managers that set torch's flags without these setters
(`torch.backends.cudnn.flags()`, `torch.backends.mkldnn.flags()`). `sdpa_kernel` needs nothing
here: the client picks the attention path itself (rgpu.attention).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from rgpu_protocol import SETTING_NAMES, Kind

CHANGES: dict[str, Any] = {}  # name -> value, in the order last set
_NAMES = frozenset(SETTING_NAMES)
_LEAVES = frozenset(n.rpartition(".")[2] for n in SETTING_NAMES)
_sessions: Callable[[], list] = list


def message() -> tuple:
    """SETTINGS with every change made so far (none: nothing to send)."""
    return (Kind.SETTINGS, [[name, value] for name, value in CHANGES.items()])


def changed(name: str, value: Any) -> None:
    """A setting took `value` here: the servers follow from the next op on."""
    CHANGES.pop(name, None)
    CHANGES[name] = list(value) if isinstance(value, tuple) else value
    msg = message()
    for s in _sessions():
        if not s.closed and s.broken is None:
            s.post(msg)


def _deterministic_changed() -> None:
    changed("deterministic", [torch.are_deterministic_algorithms_enabled(),
                              torch.is_deterministic_algorithms_warn_only_enabled()])  # fmt: skip


def _wrap(module: Any, name: str, after: Callable[[tuple], None]) -> None:
    original = getattr(module, name)
    if getattr(original, "_rgpu_followed", False):
        return

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        after(args + tuple(kwargs.values()))
        return result

    wrapper._rgpu_followed = True  # type: ignore[attr-defined]
    setattr(module, name, wrapper)


def _follow_setattr(cls: type, key: Callable[[Any, str], str]) -> None:
    """Wrap `cls.__setattr__`: an attribute of SETTING_NAMES set on an instance is a change."""
    original = cls.__setattr__
    if getattr(original, "_rgpu_followed", False):
        return

    def __setattr__(self: Any, name: str, value: Any) -> Any:
        result = original(self, name, value)
        if name in _LEAVES:
            full = key(self, name)
            if full in _NAMES:
                changed(full, value)
        return result

    __setattr__._rgpu_followed = True  # type: ignore[attr-defined]
    cls.__setattr__ = __setattr__  # type: ignore[method-assign, assignment]


def _module_key(module: Any, name: str) -> str:
    return f"{module.__name__.removeprefix('torch.')}.{name}"


def install(sessions: Callable[[], list]) -> None:
    global _sessions
    _sessions = sessions
    _wrap(torch, "use_deterministic_algorithms", lambda args: _deterministic_changed())
    _wrap(torch, "set_deterministic_debug_mode", lambda args: _deterministic_changed())
    _wrap(torch, "set_float32_matmul_precision",
          lambda args: changed("float32_matmul_precision", torch.get_float32_matmul_precision()))  # fmt: skip
    backends = torch.backends
    for module in (backends, backends.cudnn, backends.cudnn.rnn, backends.mkldnn):
        _follow_setattr(type(module), _module_key)
    _follow_setattr(type(backends.cuda.matmul), lambda m, name: f"backends.cuda.matmul.{name}")
    _follow_setattr(
        type(backends.cudnn.conv), lambda p, name: f"backends.{p.backend}.{p.op}.{name}"
    )
    _follow_setattr(type(torch.utils.deterministic), lambda m, name: name)  # type: ignore[attr-defined]
