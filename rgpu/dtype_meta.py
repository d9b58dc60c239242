"""Ops whose meta kernels answer another dtype, or refuse other inputs, than the CPU's kernels.

A dtype the client records but the server does not hold breaks every later read (a download
refused as a protocol violation, views of the wrong element size); a refusal the CPU does not make
fails a valid program. `meta_fixes.run_meta` asks `predicts(func, args, kwargs)` and, where true,
takes `run(func, args, kwargs)` instead of the meta kernel. A NotImplementedError from here makes
the plan RUN_DYN: the server's kernel decides, and its refusal is raised at the op.
"""

from __future__ import annotations

from typing import Any

import torch

from .in_place_meta import C10_NAMES

aten = torch.ops.aten


# `t << n`, `t >> n`, `t <<= n`, `t >>= n` by the `bitwise_*_shift` overload that computes the
# same: the dunders' meta kernels refuse every bool operand, where the CPU shifts in the promoted
# dtype (`bool_tensor << 1` is int64). The CPU refuses a bool or floating promoted dtype; so does
# the server, asked (`bitwise_*_shift`'s meta kernels would accept it).
_SHIFTS = {
    aten.__lshift__.Scalar: aten.bitwise_left_shift.Tensor_Scalar,
    aten.__lshift__.Tensor: aten.bitwise_left_shift.Tensor,
    aten.__lshift__.Scalar_out: aten.bitwise_left_shift.Tensor_Scalar_out,
    aten.__lshift__.Tensor_out: aten.bitwise_left_shift.Tensor_out,
    aten.__rshift__.Scalar: aten.bitwise_right_shift.Tensor_Scalar,
    aten.__rshift__.Tensor: aten.bitwise_right_shift.Tensor,
    aten.__rshift__.Scalar_out: aten.bitwise_right_shift.Tensor_Scalar_out,
    aten.__rshift__.Tensor_out: aten.bitwise_right_shift.Tensor_out,
}


def _shift(func, args: tuple, kwargs: dict) -> Any:
    functional = _SHIFT_OUTS.get(func)
    if functional is not None:
        # a generated out= kernel: the functional op, then `out` must have its dtype exactly
        if _shift(functional, args, {}).dtype != kwargs["out"].dtype:
            raise NotImplementedError("out= of another dtype: the server's kernel refuses it")
        return _SHIFTS[func](*args, **kwargs)
    in_place = _IN_PLACE_SHIFTS.get(func)
    # the shapes' and the cast's errors first, as TensorIterator raises them; the kernel's last
    out = (in_place or _SHIFTS[func])(*args, **kwargs)
    if in_place is not None:
        # `bitwise_*_shift_`'s meta kernel resizes `self` to the broadcast shape and casts the
        # result to its dtype, where the CPU refuses both
        if out.shape != args[0].shape:
            raise RuntimeError(
                f"output with shape {list(args[0].shape)} doesn't match the broadcast shape "
                f"{list(out.shape)}"
            )
        if not torch.can_cast(out.dtype, args[0].dtype):
            names = C10_NAMES
            raise RuntimeError(
                f"result type {names.get(out.dtype, out.dtype)} can't be cast to the desired "
                f"output type {names.get(args[0].dtype, args[0].dtype)}"
            )
    if isinstance(args[0], torch.Tensor) and len(args) > 1:
        dtype = torch.result_type(args[0], args[1])
        if dtype == torch.bool or dtype.is_floating_point or dtype.is_complex:
            raise NotImplementedError(f"shift of {dtype}: the server's kernel refuses it")
    return args[0] if in_place is not None else out


_SHIFT_OUTS = {
    aten.__lshift__.Scalar_out: aten.__lshift__.Scalar,
    aten.__lshift__.Tensor_out: aten.__lshift__.Tensor,
    aten.__rshift__.Scalar_out: aten.__rshift__.Scalar,
    aten.__rshift__.Tensor_out: aten.__rshift__.Tensor,
}
_IN_PLACE_SHIFTS = {
    aten.__ilshift__.Scalar: aten.bitwise_left_shift.Tensor_Scalar,
    aten.__ilshift__.Tensor: aten.bitwise_left_shift.Tensor,
    aten.__irshift__.Scalar: aten.bitwise_right_shift.Tensor_Scalar,
    aten.__irshift__.Tensor: aten.bitwise_right_shift.Tensor,
}


# pow in bool: `x ** True` copies x and `x ** False` fills ones, in bool, on the CPU; the meta
# kernels promote a bool base to int64. Every other pow whose promoted dtype is bool the CPU
# refuses ("pow" not implemented for 'Bool'): the server is asked, and raises that.
_POWS = {
    aten.pow.Tensor_Scalar, aten.pow.Tensor_Scalar_out, aten.pow_.Scalar,
    aten.pow.Tensor_Tensor, aten.pow.Tensor_Tensor_out, aten.pow_.Tensor,
    aten.pow.Scalar, aten.pow.Scalar_out,
}  # fmt: skip
_BOOL_EXPONENT = {aten.pow.Tensor_Scalar, aten.pow.Tensor_Scalar_out, aten.pow_.Scalar}


def _pow_operands(args: tuple, kwargs: dict) -> tuple:
    base = args[0] if args else kwargs.get("self")
    exponent = args[1] if len(args) > 1 else kwargs.get("exponent")
    return base, exponent


def _pow_of_bools(args: tuple, kwargs: dict) -> bool:
    """Whether this pow computes in bool (its base and exponent are bool)."""
    base, exponent = _pow_operands(args, kwargs)
    try:
        return torch.result_type(base, exponent) == torch.bool
    except Exception:
        return False  # the meta kernel gives the error


def _bool_pow(func, args: tuple, kwargs: dict) -> Any:
    base, exponent = _pow_operands(args, kwargs)
    if func not in _BOOL_EXPONENT or type(exponent) is not bool:
        raise NotImplementedError("pow in bool: the server's kernel refuses it")
    if func is aten.pow_.Scalar:
        return base
    if func is aten.pow.Tensor_Scalar:
        return torch.empty_like(base)  # laid out by TensorIterator's rule below
    out = kwargs["out"]  # any dtype holds a bool; laid out by `_lay_out_outs`
    if out.shape != base.shape:
        out.resize_(base.shape)
    return out


# Kernels that compute in their input's dtype where the meta kernels promote with another
# argument: a float64 target of `huber_loss` or `soft_margin_loss`, a float64 weight of
# `binary_cross_entropy` (class weights made with numpy), `normal(mean, std)` with a float64 std,
# `linear` of a strided batch with a float64 bias (added in place; other calls refuse it).
# CPU and CUDA run the same device-generic code (an output made like the input). Predicted in
# float64, the server's float32 result was refused at the next download. Op -> the position of
# the argument whose dtype the output takes.
_INPUT_DTYPE = {
    aten.huber_loss.default: 0,
    aten.soft_margin_loss.default: 0,
    aten.soft_margin_loss_backward.default: 1,
    aten.binary_cross_entropy.default: 0,
    aten.binary_cross_entropy_backward.default: 1,
    aten.normal.Tensor_Tensor: 0,
    aten.linear.default: 0,
}


def _others_differ(func, args: tuple, kwargs: dict) -> bool:
    dtype = args[_INPUT_DTYPE[func]].dtype
    return any(
        isinstance(a, torch.Tensor) and a.dtype.is_floating_point and a.dtype != dtype
        for a in (*args, *kwargs.values())
    )


def _in_input_dtype(func, args: tuple, kwargs: dict) -> Any:
    dtype = args[_INPUT_DTYPE[func]].dtype

    def cast(a: Any) -> Any:
        if isinstance(a, torch.Tensor) and a.dtype.is_floating_point and a.dtype != dtype:
            return a.to(dtype)  # a meta tensor: no data
        return a

    return func(*map(cast, args), **{k: cast(v) for k, v in kwargs.items()})


def predicts(func, args: tuple, kwargs: dict) -> bool:
    """Whether `run` predicts this call in place of the op's meta kernel."""
    return (
        func in _SHIFTS
        or func in _IN_PLACE_SHIFTS
        or (func in _POWS and _pow_of_bools(args, kwargs))
        or (func in _INPUT_DTYPE and _others_differ(func, args, kwargs))
    )


def run(func, args: tuple, kwargs: dict) -> Any:
    if func in _INPUT_DTYPE:
        return _in_input_dtype(func, args, kwargs)
    if func in _POWS:
        return _bool_pow(func, args, kwargs)
    return _shift(func, args, kwargs)
