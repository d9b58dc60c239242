"""torch's numeric settings, followed on the server: `torch.use_deterministic_algorithms`,
`torch.utils.deterministic.fill_uninitialized_memory`, `torch.set_float32_matmul_precision`
(TF32), and the flags of `torch.backends.cuda.matmul`, `.cudnn` and `.mkldnn`.

torch keeps them per process, so the user's calls would change only the laptop's torch, and a
GPU host would go on without TF32 or determinism, with no error. Their setters are wrapped here:
each change goes to every connected server as a SETTINGS message, in order with the ops around
it (docs/protocol.md), and a session opened later gets the changes made before it. The names
and values are those of rgpu_protocol.SETTING_NAMES.

`torch.backends.cudnn.flags()` and `torch.backends.mkldnn.flags()` set theirs through `set_flags`,
wrapped too. `sdpa_kernel` needs nothing here: the client picks the attention path itself
(rgpu.attention).
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

# torch's values in a fresh process, for the settings a program may have changed before it
# imported rgpu (read at install, in this order: the precision first, the flags it implies after)
TORCH_DEFAULTS: dict[str, Any] = {
    "float32_matmul_precision": "highest",
    "deterministic": [False, False],
    "fill_uninitialized_memory": True,
    "backends.cuda.matmul.allow_tf32": False,
    "backends.cuda.matmul.allow_fp16_reduced_precision_reduction": True,
    "backends.cuda.matmul.allow_bf16_reduced_precision_reduction": True,
    "backends.cudnn.enabled": True,
    "backends.cudnn.benchmark": False,
    "backends.cudnn.deterministic": False,
    "backends.cudnn.allow_tf32": True,
    "backends.mkldnn.enabled": True,
    "backends.mkldnn.deterministic": False,
    "backends.cuda.matmul.fp32_precision": "none",
    "backends.mkldnn.matmul.fp32_precision": "none",
}
# flags no other setting implies: back at torch's value, they need no message at all (Dynamo
# sets "deterministic" back after every frame it compiles; a library may toggle it around a call)
_INDEPENDENT = frozenset({
    "deterministic", "fill_uninitialized_memory", "backends.cudnn.enabled",
    "backends.cudnn.benchmark", "backends.cudnn.deterministic", "backends.mkldnn.enabled",
    "backends.mkldnn.deterministic",
})  # fmt: skip


def message() -> tuple:
    """SETTINGS with every change made so far, in order."""
    return (Kind.SETTINGS, [[name, value] for name, value in CHANGES.items()])


def changed(name: str, value: Any, *more: tuple[str, Any]) -> None:
    """A setting took `value` here (and those of `more` theirs): the servers follow from the
    next op on, with one message (none when nothing changed)."""
    before = list(CHANGES.items())
    for key, v in ((name, value), *more):
        v = list(v) if isinstance(v, tuple) else v
        if key in _INDEPENDENT:
            if CHANGES.get(key, TORCH_DEFAULTS[key]) == v:
                continue  # as it was
            CHANGES.pop(key, None)
            if v != TORCH_DEFAULTS[key]:
                CHANGES[key] = v
        else:  # the last one set wins over the flags it implies: it moves to the end
            CHANGES.pop(key, None)
            CHANGES[key] = v
    if list(CHANGES.items()) == before:
        return
    msg = message()
    for s in _sessions():
        if not s.closed and s.broken is None:
            s.post(msg)


def _changed_before_import() -> None:
    """Settings the program changed before rgpu was imported: recorded as changes."""
    for name, default in TORCH_DEFAULTS.items():
        try:
            value = _GETTERS.get(name, _attribute)(name)
        except (AttributeError, RuntimeError):  # a mix of TF32 APIs torch refuses to read back
            continue
        value = list(value) if isinstance(value, tuple) else value
        if value != default:
            CHANGES[name] = value


def _attribute(name: str) -> Any:
    owner: Any = torch
    path, _, attr = name.rpartition(".")
    for part in path.split("."):
        owner = getattr(owner, part)
    return getattr(owner, attr)


_GETTERS: dict[str, Callable[[str], Any]] = {
    "float32_matmul_precision": lambda _: torch.get_float32_matmul_precision(),
    "deterministic": lambda _: [torch.are_deterministic_algorithms_enabled(),
                                torch.is_deterministic_algorithms_warn_only_enabled()],
    "fill_uninitialized_memory": lambda _: torch.utils.deterministic.fill_uninitialized_memory,  # type: ignore[attr-defined]
}  # fmt: skip


def _deterministic_changed() -> None:
    changed("deterministic", _GETTERS["deterministic"]("deterministic"))


def _flags_changed(backend: str, names: tuple[str, ...], args: tuple, kwargs: dict) -> None:
    """`torch.backends.<backend>.set_flags(...)` (what its `flags()` context manager calls on
    entry and exit) set the flags it was given, positionally or as `_name=`."""
    given = dict(zip(names, args)) | {k.lstrip("_"): v for k, v in kwargs.items()}
    pairs = [(f"backends.{backend}.{n}", v) for n, v in given.items() if v is not None]
    pairs = [(n, v) for n, v in pairs if n in _NAMES]  # not depthwise_kernel: torch 2.13's only
    if pairs:
        changed(*pairs[0], *pairs[1:])


def _wrap(module: Any, name: str, after: Callable[[tuple, dict], None]) -> None:
    original = getattr(module, name)
    if getattr(original, "_rgpu_followed", False):
        return

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        after(args, kwargs)
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
    _changed_before_import()
    _wrap(torch, "use_deterministic_algorithms", lambda a, k: _deterministic_changed())
    _wrap(torch, "set_deterministic_debug_mode", lambda a, k: _deterministic_changed())
    _wrap(torch, "set_float32_matmul_precision",
          lambda a, k: changed("float32_matmul_precision", torch.get_float32_matmul_precision()))  # fmt: skip
    backends = torch.backends
    cudnn = (
        "enabled",
        "benchmark",
        "benchmark_limit",
        "deterministic",
        "allow_tf32",
        "fp32_precision",
    )
    # flags() finds set_flags in the module torch.backends.cudnn wraps (PropModule.m)
    _wrap(backends.cudnn.m, "set_flags", lambda a, k: _flags_changed("cudnn", cudnn, a, k))
    mkldnn = ("enabled", "deterministic", "allow_tf32", "fp32_precision")
    _wrap(backends.mkldnn.m, "set_flags", lambda a, k: _flags_changed("mkldnn", mkldnn, a, k))
    for module in (backends, backends.cudnn, backends.cudnn.rnn, backends.mkldnn):
        _follow_setattr(type(module), _module_key)
    _follow_setattr(type(backends.cuda.matmul), lambda m, name: f"backends.cuda.matmul.{name}")
    _follow_setattr(
        type(backends.cudnn.conv), lambda p, name: f"backends.{p.backend}.{p.op}.{name}"
    )
    _follow_setattr(type(torch.utils.deterministic), lambda m, name: name)  # type: ignore[attr-defined]
