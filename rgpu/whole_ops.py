"""Ops PyTorch breaks into smaller ones only on devices that lack their kernel.

A few aten ops have CPU and CUDA kernels and also a `CompositeImplicitAutograd` formula that
the dispatcher uses for every other device. On rgpu the formula would run: several messages
where the CPU runs one kernel, and different rounding. `silu_backward` is one: SiLU's gradient
on rgpu differed from the CPU's in the last bits, so Llama's weights drifted from local CPU
torch's after the first optimizer step. An `AutogradPrivateUse1` kernel sends these ops whole;
when their own gradient is needed (double backward) the formula runs, as on the CPU.

`linear`, `matmul` and the softmaxes are composites everywhere, but without a gradient to record
they go whole as well: one dispatch and one message instead of three to five (a weight's `t`,
reshapes, `mm`), which cut the client's CPU per `linear` from ~108 to ~32 us here, the server
running the composition PyTorch's own C++ runs locally. Recurrent layers (`nn.LSTM`, `GRU`, `RNN`)
go whole without grad mode: one message for the sequence instead of several per time step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.autograd.forward_ad as _forward_ad

aten = torch.ops.aten
# aten ops with a CPU kernel and a CompositeImplicitAutograd formula (tests/test_whole_ops.py
# finds them in the installed PyTorch and checks this list is complete)
WHOLE = ("silu_backward", "mish_backward", "native_channel_shuffle")
# recurrent layers: broken up, a sequence is a few messages per time step and rounds differently
# from the CPU's own kernels (oneDNN's, or the fused cells); whole, the server runs its own. Only
# with grad mode off: the CPU picks its kernel by grad mode (oneDNN's only without), and the
# server runs these ops with it off
RNNS = tuple(f"{rnn}.{overload}" for rnn in ("lstm", "gru", "rnn_tanh", "rnn_relu")
             for overload in ("input", "data"))  # fmt: skip
# CompositeImplicitAutograd ops that compute fresh outputs: when no gradient is needed (inference,
# generation) they go whole too and the server runs PyTorch's own composition of them, the very
# code local torch runs; with a gradient they break up here so autograd records their parts
WHOLE_WITHOUT_GRAD = ("linear", "matmul", "softmax.int", "log_softmax.int", *RNNS)
_GRAD_MODE_PICKS: set = set()  # the RNN overloads: the CPU picks their kernel by grad mode


_LINEAR = aten.linear.default
_MATMULS = (aten.linear.default, aten.matmul.default)


def _needs_grad(args: tuple, kwargs: dict) -> bool:
    # forward-mode AD (`torch.autograd.forward_ad`, `torch.func.jvp`/`jacfwd`) records tangents
    # without requires_grad; sent whole, an op lost its tangent and `jvp` of `A @ x` came out
    # wrong with no error. Broken up, its parts carry their forward formulas, as on the CPU.
    if _forward_ad._current_level >= 0 and torch._C._is_fwd_grad_enabled():
        return True
    if not torch.is_grad_enabled():
        return False
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor) and a.requires_grad:
            return True
        if isinstance(a, (list, tuple)) and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in a
        ):
            return True
    return False


def _folds_differently(op: torch._ops.OpOverload, args: tuple) -> bool:
    """True when PyTorch's `matmul` would fold this call into one `mm` here but not on the server.

    `should_fold` (aten/src/ATen/native/LinearAlgebra.cpp) folds a batched operand times a matrix
    whenever the matrix requires grad, which a parameter does even with grad disabled, and
    otherwise only when the batch dims merge without a copy. No server tensor requires grad, so
    for a sliced input (`hidden[:, -1:]` into `lm_head`, as generation does) the server would
    run `bmm` and round differently from local torch; such a call breaks up here instead.
    """
    if len(args) < 2:
        return False
    a, b = args[0], args[1]
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return False
    if op is _LINEAR:  # linear's matmul is input @ weight.t()
        larger, small = a, b
        shape, stride = a.shape, a.stride()
    elif a.dim() >= b.dim():
        larger, small = a, b
        shape, stride = a.shape, a.stride()
    else:
        larger, small = b, a
        shape = (*b.shape[:-2], b.shape[-1], b.shape[-2]) if b.dim() >= 2 else b.shape
        stride = (*b.stride()[:-2], b.stride()[-1], b.stride()[-2]) if b.dim() >= 2 else b.stride()
    if larger.dim() < 3 or small.dim() > 2 or not small.requires_grad:
        return False
    if a.dim() == 2:
        return True  # the server would not fold
    if larger.numel() == 0:
        return False
    return any(stride[i] != stride[i + 1] * shape[i + 1] for i in range(len(shape) - 2))


_COMPOSITE = torch._C.DispatchKey.CompositeImplicitAutograd
# .op: the op this thread's autograd kernel (below) chose to send whole
_sent_whole = threading.local()


def _breaks_up(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> bool:
    return (
        _needs_grad(args, kwargs)
        or (op in _MATMULS and _folds_differently(op, args))
        or (op in _GRAD_MODE_PICKS and torch.is_grad_enabled())
    )


def _adds_bias_in_place(args: tuple, kwargs: dict) -> bool:
    """`linear` of a strided batch with a bias of another dtype: PyTorch's formula adds it in
    place (`add_`, the input's dtype) for a plain tensor but out of place (promoted) for a
    subclass, so a float64 bias made the output float64 on rgpu, float32 on CPU and CUDA."""
    x, bias = args[0], args[2] if len(args) > 2 else kwargs.get("bias")
    return (
        isinstance(bias, torch.Tensor)
        and bias.dtype != x.dtype
        and x.dim() > 2
        and not x.is_contiguous()
    )


def _kernel(op: torch._ops.OpOverload) -> Callable[..., Any]:
    # PyTorch's C++ formula, the one local torch runs; not `op.decompose`, which prefers a
    # Python port where one is registered (matmul's took ~7% of a Llama training step's client
    # time here)

    def run(*args: Any, **kwargs: Any) -> Any:
        if _breaks_up(op, args, kwargs):
            if op is _LINEAR and _adds_bias_in_place(args, kwargs):
                out = op._op_dk(_COMPOSITE, args[0], args[1])
                return out.add_(args[2] if len(args) > 2 else kwargs["bias"])
            return op._op_dk(_COMPOSITE, *args, **kwargs)
        with torch._C._AutoDispatchBelowAutograd():
            _sent_whole.op = op
            try:
                return op(*args, **kwargs)
            finally:
                _sent_whole.op = None

    return run


def _below_autograd(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    """The op reached the device with autograd's kernel skipped (inference mode, a custom op's
    body): decide as that kernel would. NotImplemented: send it whole."""
    if getattr(_sent_whole, "op", None) is op:  # the kernel above decided already
        return NotImplemented
    if _breaks_up(op, args, kwargs):
        return op._op_dk(_COMPOSITE, *args, **kwargs)
    return NotImplemented


def install(lib: torch.library.Library, composite: dict) -> None:
    """Autograd kernels for the ops sent whole, and their handlers in `composite`
    (rgpu.plans.COMPOSITE) for when they reach the device with autograd skipped."""
    for name in WHOLE + WHOLE_WITHOUT_GRAD:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(aten, packet), overload or "default")
        if name in RNNS:
            _GRAD_MODE_PICKS.add(op)
        lib.impl(name, _kernel(op), "AutogradPrivateUse1")
        composite[op] = _below_autograd
