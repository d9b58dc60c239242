"""out= tensors laid out as the CPU's kernels lay them out.

A kernel restrides an out= tensor only when it resizes it (its shape was not the result's): the
generated `resize_out` of a structured kernel and TensorIterator's `allocate_or_resize_outputs`
resize it, then `as_strided_` it to the strides computed from the inputs alone (or restride it to
a memory format, as `cat` does); an out= tensor of the right shape keeps its strides and offset.
The Python meta kernels resize row-major (`_maybe_resize_out`), and a few (`sort`'s) restride an
out= tensor of the right shape too: the client recorded a transposed input's `exp(x, out=empty)`
row-major where the server held it transposed, and every view of it read the wrong elements.
`meta_fixes.run_meta` calls `out_arguments` before the meta kernel runs and `lay_out` after.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from .strides import tensor_iterator_strides

aten = torch.ops.aten

# Which out= overloads lay a resized tensor out as their functional overload lays out its fresh
# output: those with a CPU kernel of their own whose functional overload runs through
# TensorIterator, and those in `_OUT_AS_FUNCTIONAL`: CompositeExplicitAutograd kernels that call
# another op's out= overload (`deg2rad` is `mul_out`; `bitwise_and.Scalar_out` is
# `bitwise_and_out` of a wrapped number), `addr` (a TensorIterator kernel without the pointwise
# tag), `cat` (restrided to its inputs' memory format) and LAPACK's kernels (their structured
# metas ask for column-major strides, `out` given or not). Generated out= overloads (the
# functional op, then `resize_output` row-major and a copy: `add.Scalar_out`, `relu.out`, ...)
# and the kernels that copy into `out` likewise (nan_to_num of integers, abs and angle of complex
# numbers into real ones) stay row-major, as the meta kernels leave them (ldexp and mvlgamma, whose
# layout only the server knows, run through RUN_DYN, which reports `out`'s layout). Checked
# against the CPU for every out= overload the OpInfo samples reach and for random layouts of
# every pointwise op's out= overloads (tests/test_meta_fixes.py).
_OUT_AS_FUNCTIONAL = {
    "cat", "deg2rad", "rad2deg", "addr", "linalg_lu_solve", "linalg_qr", "triangular_solve",
    "_linalg_eigh", "linalg_ldl_factor_ex", "linalg_ldl_solve", "_linalg_slogdet",
    "linalg_lu_factor_ex", "bitwise_and.Scalar_out", "bitwise_or.Scalar_out",
    "bitwise_xor.Scalar_out", "bitwise_left_shift.Tensor_Scalar_out",
    "bitwise_right_shift.Tensor_Scalar_out", "copysign.Scalar_out", "fmod.Scalar_out",
    "remainder.Scalar_out", "xlogy.OutScalar_Self", "xlogy.OutScalar_Other",
    "special_xlog1py.self_scalar_out", "special_xlog1py.other_scalar_out",
    "special_zeta.self_scalar_out", "special_zeta.other_scalar_out",
}  # fmt: skip
# the orthogonal polynomials' out= overloads of a number are their Tensor overload's
_POLYNOMIAL_OF_A_NUMBER = re.compile(r"^special_\w+_polynomial_\w+\.[nx]_scalar_out$")
# column-major as their functional overload only when `out` had no elements; row-major otherwise
_OUT_AS_FUNCTIONAL_WHEN_EMPTY = {"linalg_householder_product", "ormqr"}
_MISSING = object()
# out= overload -> its functional overload when a resized `out` takes that one's layout (else None)
_RESTRIDES_OUT: dict[Any, Any] = {}


def _functional_of_out(func, follows_tensor_iterator) -> Any:
    """`aten.add.Tensor` for `aten.add.out`, where a resized `out` is laid out as the functional
    op's output; None where it stays row-major (or the op has no such overload)."""
    schema = func._schema
    outs = [a for a in schema.arguments if a.is_out]
    name = schema.name.split("::", 1)[1]
    if not outs or func.namespace != "aten" or torch.Tag.out not in func.tags:
        return None
    listed = (
        name in _OUT_AS_FUNCTIONAL
        or f"{name}.{func._overloadname}" in _OUT_AS_FUNCTIONAL
        or bool(_POLYNOMIAL_OF_A_NUMBER.match(f"{name}.{func._overloadname}"))
        or name in _OUT_AS_FUNCTIONAL_WHEN_EMPTY
    )
    if (
        not listed
        # an out= overload with no CPU kernel of its own (CompositeExplicitAutograd) is generated
        and not torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CPU")
    ):
        return None
    inputs = [(a.name, str(a.type)) for a in schema.arguments if not a.is_out]
    packet = getattr(aten, name, None)
    for overload in packet.overloads() if packet is not None else ():
        op = getattr(packet, overload)
        s = op._schema
        if (
            not s.is_mutable
            and len(s.returns) == len(outs)
            and [(a.name, str(a.type)) for a in s.arguments] == inputs
        ):
            return op if listed or follows_tensor_iterator(op) else None
    return None


def out_arguments(func, args: tuple, kwargs: dict) -> list:
    """The op's out= tensors before it runs, as (argument position, name, tensor, shape, strides,
    offset); empty for an op without out= arguments."""
    if not func._schema.is_mutable:
        return []
    found = []
    for i, a in enumerate(func._schema.arguments):
        if a.is_out:
            t = args[i] if i < len(args) else kwargs.get(a.name)
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                found.append((i, a.name, t, tuple(t.shape), t.stride(), t.storage_offset()))
    return found


def lay_out(
    func, found: list, args: tuple, kwargs: dict, device: str, follows_tensor_iterator, predict
) -> None:
    """Lay the out= tensors `found` (`out_arguments`) out as the CPU's kernels do, after the meta
    kernel ran. `follows_tensor_iterator(op)`: whether the functional op runs through
    TensorIterator; `predict(op, args, kwargs, device)`: its predicted outputs, or None where only
    the server knows them (`meta_fixes` passes both: it imports this module)."""
    resized = []
    for _, _, t, shape, stride, offset in found:
        if tuple(t.shape) != shape:
            resized.append(t)
        elif t.stride() != stride or t.storage_offset() != offset:
            t.as_strided_(shape, stride, offset)  # not resized: it keeps its own layout
    if not resized:
        return
    functional = _RESTRIDES_OUT.get(func, _MISSING)
    if functional is _MISSING:
        functional = _RESTRIDES_OUT[func] = _functional_of_out(func, follows_tensor_iterator)
    if functional is None or _copied_into_out(functional, args, found[0][2]):
        return
    if functional in _COMPLEX_TO_REAL and args[0].is_complex():  # into a complex `out`
        strides = tensor_iterator_strides(
            [(tuple(args[0].shape), args[0].stride())], resized[0].shape
        )
        if strides is not None:
            resized[0].as_strided_(resized[0].shape, strides)
        return
    positions = {i for i, *_ in found}
    names = {n for _, n, *_ in found}
    fargs = tuple(a for i, a in enumerate(args) if i not in positions)
    fkwargs = {k: v for k, v in kwargs.items() if k not in names}
    try:
        fresh = predict(functional, fargs, fkwargs, device)
    except Exception:
        return
    if fresh is None:
        return
    fresh = fresh if isinstance(fresh, tuple) else (fresh,)
    when_empty = functional.__name__.split(".")[0] in _OUT_AS_FUNCTIONAL_WHEN_EMPTY
    for (_, _, t, shape, _, _), f in zip(found, fresh):
        if when_empty and math.prod(shape) != 0:
            continue
        if tuple(t.shape) != shape and isinstance(f, torch.Tensor) and t.shape == f.shape:
            if t.stride() != f.stride():
                t.as_strided_(t.shape, f.stride())


_COMPLEX_TO_REAL = {aten.abs.default, aten.angle.default}


def _copied_into_out(functional, args: tuple, out: torch.Tensor) -> bool:
    """Kernels that compute elsewhere and copy into a row-major `out`, for these arguments."""
    if functional is aten.nan_to_num.default:  # integers: copied as they are
        return not (args[0].is_floating_point() or args[0].is_complex())
    if functional in _COMPLEX_TO_REAL:  # complex numbers into a real `out`
        return args[0].is_complex() and not out.is_complex()
    return False
