"""An error during backward on rgpu tensors reaches `.backward()` / `autograd.grad()`, as on the
CPU, instead of killing the process.

PyTorch runs a Python backend's device guard as Python code. When a tensor hook or an rgpu op
raises inside the autograd engine, the engine unwinds with the Python error still pending (it
saves it only later), and the stream guard it unwinds through calls that Python guard: the call
fails inside a `noexcept` destructor and `std::terminate` aborts the process (the notebook's
kernel dies; "terminate called without an active exception"). Errors PyTorch raises in C++ (a
gradient of the wrong shape) unwind cleanly.

So no Python exception leaves a hook or an op while backward runs: the exception is recorded, a
failing hook leaves its gradient as it was, and a failing op returns empty placeholders (the
engine then stops on its own C++ shape check, or finishes). `backward()` and `grad()` raise the
first recorded exception, with its traceback, once the engine returns.

The same wrapper runs every backward in the thread that called it
(`torch.autograd.set_multithreading_enabled(False)` for the call). Autograd sizes its per-device
threads once, at the first backward of the process: a backward on the CPU before `import rgpu`
left rgpu without one, and every rgpu backward after it failed an INTERNAL ASSERT in engine.cpp
(the device index past its ready queues). On the calling thread the engine needs none. There,
a Ctrl-C would raise KeyboardInterrupt inside an op the engine runs, and abort the process as
above; so the main thread's SIGINT handler is held during the call and runs once the engine
returns, which is when the interrupt came out of a backward on autograd's own threads (and on the
CPU, whose backward runs no Python).
"""

from __future__ import annotations

import functools
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

_graph_task_id = torch._C._current_graph_task_id
_recorded: list[BaseException] = []
_lock = threading.Lock()
_installed: list[bool] = []


def in_backward() -> bool:
    return _graph_task_id() != -1


def nested(code: Any) -> bool:
    """True when an outer frame runs `code` (rgpu's dispatch): an op rgpu runs while
    dispatching another raises to its caller, which may handle it."""
    try:
        frame = sys._getframe(2)
    except ValueError:  # the dispatch is the thread's first Python frame (autograd's threads)
        return False
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def record(e: BaseException) -> None:
    with _lock:
        if not _recorded:
            _recorded.append(e)


def _take() -> BaseException | None:
    with _lock:
        e = _recorded[0] if _recorded else None
        _recorded.clear()
    return e


def placeholder(e: BaseException, func: Any) -> Any:
    """What a failing op returns inside backward: empty rgpu tensors in the shape of its
    returns (the exception is recorded); ops returning anything else re-raise."""
    outs: list[Any] = []
    for ret in func._schema.returns:
        kind = str(ret.type)
        if kind.startswith("Tensor") and not kind.startswith("Tensor["):
            outs.append(torch.empty(0, device="rgpu"))
        elif kind.startswith("Tensor[]") or kind.startswith("List[Tensor]"):
            outs.append([])
        else:
            raise e
    record(e)
    if len(outs) == 1:
        return outs[0]
    return tuple(outs)


def guarded(hook: Callable) -> Callable:
    """A tensor hook that records its exception (or a wrong return) instead of raising it."""

    @functools.wraps(hook)
    def run(*args: Any) -> Any:
        try:
            out = hook(*args)
        except BaseException as e:
            record(e)
            return None
        if out is not None and not isinstance(out, torch.Tensor):
            record(TypeError(f"expected Variable, but hook returned '{type(out).__name__}'"))
            return None
        return out

    return run


def _on_rgpu(args: Any) -> bool:
    return any(
        type(x) is not torch.Tensor and isinstance(x, torch.Tensor) and x.device.type == "rgpu"
        for x in torch.utils._pytree.tree_leaves(args)
    )


def _guarded_module_hook(hook: Callable) -> Callable:
    """A module's backward hook (run from a hook on an autograd node, which cannot be wrapped
    when registered): on rgpu gradients, its exception is recorded instead of raised."""

    @functools.wraps(hook)
    def run(*args: Any) -> Any:
        try:
            return hook(*args)
        except BaseException as e:
            if not _on_rgpu(args[1:]):
                raise
            record(e)
            return None

    return run


_multithreading = torch._C._is_multithreading_enabled
_set_multithreading = torch._C._set_multithreading_enabled


def _raising_recorded(run_backward: Callable) -> Callable:
    @functools.wraps(run_backward)
    def run(*args: Any, **kwargs: Any) -> Any:
        _take()  # nothing left over from an earlier backward
        threads = _multithreading()
        _set_multithreading(False)  # see the module's docstring
        try:
            out = _holding_interrupts(run_backward, args, kwargs)
        except Exception:
            e = _take()
            if e is None:
                raise
            raise e.with_traceback(e.__traceback__) from None
        finally:
            _set_multithreading(threads)
        e = _take()
        if e is not None:
            raise e.with_traceback(e.__traceback__)
        return out

    return run


_held: list | None = None  # SIGINTs that came during the backward the main thread runs


def _hold(signum: int, frame: Any) -> None:
    if _held is not None:
        _held.append((signum, frame))


def _holding_interrupts(run_backward: Callable, args: tuple, kwargs: dict) -> Any:
    """Run the engine with SIGINT's Python handler held (the main thread's outermost backward),
    then run the handler for an interrupt that came meanwhile."""
    global _held
    if _held is not None or threading.current_thread() is not threading.main_thread():
        return run_backward(*args, **kwargs)  # a nested backward, or no signals in this thread
    handler = signal.getsignal(signal.SIGINT)
    if not callable(handler):  # SIG_DFL, SIG_IGN: no Python code runs on Ctrl-C
        return run_backward(*args, **kwargs)
    _held = []
    signal.signal(signal.SIGINT, _hold)
    try:
        return run_backward(*args, **kwargs)
    finally:
        held, _held = _held, None
        signal.signal(signal.SIGINT, handler)
        if held:
            handler(*held[0])  # KeyboardInterrupt, under Python's default handler


def install() -> None:
    """Route torch.autograd.backward / grad (and Tensor.backward) through the check, and guard
    modules' backward hooks."""
    if _installed:
        return
    import torch.autograd as autograd
    import torch.autograd.graph as graph
    import torch.utils.hooks as hooks

    wrapped = _raising_recorded(graph._engine_run_backward)
    graph._engine_run_backward = wrapped
    autograd._engine_run_backward = wrapped
    init = hooks.BackwardHook.__init__

    @functools.wraps(init)
    def backward_hook_init(self: Any, module: Any, user_hooks: list, user_pre_hooks: list) -> None:
        init(
            self,
            module,
            [_guarded_module_hook(h) for h in user_hooks],
            [_guarded_module_hook(h) for h in user_pre_hooks],
        )

    hooks.BackwardHook.__init__ = backward_hook_init
    _installed.append(True)
