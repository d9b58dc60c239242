"""`torch.set_default_dtype` on the client, reproduced on a server that keeps float32.

PyTorch's default dtype is process-global, so the server cannot switch it per session; it always
computes with float32. The client's meta inference, though, runs under the user's default, so an
op whose output dtype comes from the default (a factory without `dtype=`, `int_t / 2`,
`int_t * 0.5`, `torch.sqrt(int_t)`) was predicted float64 while the server made float32: reads
failed on the byte count or, worse, later ops computed in float32 (silently wrong values).

`dispatch` calls `rewrite` only while the default is not float32 (the hot path pays one identity
check); plan keys then carry the default dtype, so a plan inferred under one default is never
reused under another. Each key is classified once (`_ACTIONS`): an op depends on the default when
a fresh output is floating or complex while no tensor input is and no `dtype` was given. Such an
op is sent in a form that names the dtype the client predicted, so the server's default no longer
matters:

* `dtype=<the output's dtype>` added, when the op takes a `dtype` argument (every factory,
  `linspace` of tensors);
* otherwise its integral inputs cast to the output's real dtype first, bool ones left alone where
  that suffices (`where`'s condition) — what TensorIterator does on the CPU, which converts
  integer operands to the common (default) dtype before computing.

Also: `linspace`/`logspace` of tensors take the default whatever their tensors' dtype; an
`out=` op casts its integral inputs to its functional op's (default) dtype, as the CPU computes
in that dtype before writing `out`; a LEARN plan's dtypes come from meta inference (`ldexp`'s
decomposition says float32 for integers, where the CPU's `self * pow(2.0, other)` gives the
default); a factory's complex fill value gives c10's default complex dtype (complex64 under
float16, where the Python meta kernel says complex32). DYN plans (the server reports the
outputs) are left alone: of the OpInfo samples of integers tried, none made a DYN plan with a
floating output.

A rewrite is accepted only when meta inference of the rewritten op predicts the same output
dtypes and shapes (and the re-dispatched outputs are checked again); an op no rewrite
reproduces raises a RuntimeError instead of computing in float32.
"""

from __future__ import annotations

from typing import Any

import torch

from . import meta_fixes
from .plans import DYN, LEARN, _flat_new_keys, infer
from .tensor import DEVICE_TYPE, RemoteTensor, meta_of_key

aten = torch.ops.aten
_META = torch.device("meta")
_NORMAL = 0  # the op does not depend on the default dtype: the plan path sends it as it is
_ADD_DTYPE = 1  # payload: the dtype to pass as `dtype=`
_CAST = 2  # payload: (real dtype, whether bool tensors are cast too, `out=` names left alone)
_REFUSE = 3  # payload: the message
_ACTIONS: dict = {}  # plan key (with the default dtype) -> (action, payload, outputs wanted)


_COMPLEX = {torch.float64: torch.complex128, torch.float32: torch.complex64,
            torch.float16: torch.complex64, torch.bfloat16: torch.complex64}  # fmt: skip


_FACTORIES_OF_TENSORS = {
    getattr(getattr(aten, name), overload)
    for name in ("linspace", "logspace")
    for overload in ("Tensor_Tensor", "Tensor_Scalar", "Scalar_Tensor")
}


def _dtype_index(func) -> int | None:
    for i, a in enumerate(func._schema.arguments):
        if a.name == "dtype":
            return i
    return None


def _given_dtype(func, args: tuple, kwargs: dict) -> bool:
    if kwargs.get("dtype") is not None:
        return True
    i = _dtype_index(func)
    return i is not None and i < len(args) and args[i] is not None


def _tensors(x: Any, out: list) -> list:
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif type(x) in (list, tuple):
        for y in x:
            _tensors(y, out)
    elif type(x) is dict:
        for y in x.values():
            _tensors(y, out)
    return out


def _inexact(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


def _new_dtypes_shapes(plan) -> list:
    return [(k[0], k[1]) for k in _flat_new_keys(plan.spec) if k is not None]


def _result_dtypes_shapes(out: Any) -> list:
    return [(t.dtype, tuple(t.shape)) for t in _tensors(out, [])]


def _cast_to(x: Any, dtype: torch.dtype, with_bool: bool, cast) -> Any:
    """`x` with its integral tensors (bool ones only `with_bool`) converted by `cast`."""
    if isinstance(x, torch.Tensor):
        if _inexact(x.dtype) or (x.dtype is torch.bool and not with_bool):
            return x
        return cast(x, dtype)
    if type(x) in (list, tuple):
        return type(x)(_cast_to(y, dtype, with_bool, cast) for y in x)
    return x


def _to_meta(x: Any) -> Any:
    if type(x) is RemoteTensor:
        return meta_of_key(x._r.key)
    if isinstance(x, torch.Tensor):
        return x
    if type(x) in (list, tuple):
        return type(x)(_to_meta(y) for y in x)
    if type(x) is torch.device and x.type == DEVICE_TYPE:
        return _META
    return x


def _meta_outputs(func, args: tuple, kwargs: dict, sess) -> list | None:
    """The (dtype, shape) of each output meta inference predicts, or None where it fails."""
    margs = tuple(_to_meta(a) for a in args)
    mkwargs = {k: _to_meta(v) for k, v in kwargs.items()}
    try:
        out = meta_fixes.run_meta(func, margs, mkwargs, meta_fixes.device_type(sess.device))
    except Exception:
        return None
    return _result_dtypes_shapes(out)


def _meta_fits(func, args: tuple, kwargs: dict, want: list, sess) -> bool:
    """Meta inference of the rewritten op predicts the outputs the plan holds."""
    return _meta_outputs(func, args, kwargs, sess) == want


def _with_dtype(func, args: tuple, kwargs: dict, dtype: torch.dtype) -> tuple[tuple, dict]:
    i = _dtype_index(func)
    if i is not None and i < len(args):
        return args[:i] + (dtype,) + args[i + 1 :], kwargs
    return args, dict(kwargs, dtype=dtype)


def _classify(func, args: tuple, kwargs: dict, plan, sess, default: torch.dtype) -> tuple:
    """(action, payload, the output dtypes and shapes the CPU makes) for one plan key."""
    if plan is DYN or (plan is not LEARN and plan.view) or _given_dtype(func, args, kwargs):
        return (_NORMAL, None, None)
    outs = frozenset(a.name for a in func._schema.arguments if a.is_out and a.name in kwargs)
    inputs = _tensors(args, _tensors({k: v for k, v in kwargs.items() if k not in outs}, []))
    if func in _FACTORIES_OF_TENSORS:
        inputs = []  # their dtype is the default whatever the dtype of `start` and `end`
    elif any(_inexact(t.dtype) for t in inputs):
        return (_NORMAL, None, None)
    if outs:  # `out=`: the inputs are converted to the functional op's dtype first on the CPU
        functional = _functional(func)
        fkwargs = {k: v for k, v in kwargs.items() if k not in outs}
        fwant = _meta_outputs(functional, args, fkwargs, sess) if functional else None
        want = _meta_outputs(func, args, kwargs, sess)
        if not fwant or not want or not any(_inexact(d) for d, _ in fwant):
            return (_NORMAL, None, None)
        cast = _casts(func, args, kwargs, outs, inputs, fwant[0][0].to_real(), want, sess)
        return cast or (_REFUSE, _refusal(func, default), want)
    # a LEARN plan (`ldexp`, `mvlgamma`) learns its layout from the server; meta inference
    # still knows its dtypes
    want = _meta_outputs(func, args, kwargs, sess) if plan is LEARN else _new_dtypes_shapes(plan)
    if not want or not any(_inexact(d) for d, _ in want):
        return (_NORMAL, None, None)
    if func is aten.ldexp.Tensor:  # its decomposition makes float32 of integers; the CPU's
        want = [(default, s) for _, s in want]  # kernel is self * pow(2.0, other): the default
    if not inputs:  # a factory given a complex fill value takes c10's default complex dtype:
        # complex64 under float16, where its Python meta kernel says complex32
        want = [(_COMPLEX[default] if d.is_complex else d, s) for d, s in want]
    inexact_out = [d for d, _ in want if _inexact(d)]
    out_dtype = inexact_out[0]
    if _dtype_index(func) is not None and all(d == out_dtype for d, _ in want):
        a2, k2 = _with_dtype(func, args, kwargs, out_dtype)
        if _meta_fits(func, a2, k2, want, sess):
            return (_ADD_DTYPE, out_dtype, want)
    real = out_dtype.to_real()
    if all(d.to_real() == real for d in inexact_out):
        cast = _casts(func, args, kwargs, outs, inputs, real, want, sess)
        if cast is not None:
            return cast
    return (_REFUSE, _refusal(func, default), want)


def _casts(func, args, kwargs, outs, inputs, real, want, sess) -> tuple | None:
    """The op with its integral inputs cast to `real` (bool ones left alone where that is
    enough), if meta inference then predicts `want`."""
    bools = [t.dtype is torch.bool for t in inputs]
    for with_bool in (False, True):
        if (with_bool and not any(bools)) or (not with_bool and all(bools)):
            continue  # this choice casts nothing (or the same as the one before)
        margs = tuple(_cast_to(_to_meta(a), real, with_bool, torch.Tensor.to) for a in args)
        mkwargs = {
            k: v if k in outs else _cast_to(_to_meta(v), real, with_bool, torch.Tensor.to)
            for k, v in kwargs.items()
        }
        if _meta_fits(func, margs, mkwargs, want, sess):
            return (_CAST, (real, with_bool, outs), want)
    return None


def _functional(func) -> Any:
    """`aten.div.Tensor` for `aten.div.out`: the overload taking the same inputs, no `out`."""
    inputs = [(a.name, str(a.type)) for a in func._schema.arguments if not a.is_out]
    packet = getattr(aten, func._schema.name.split("::", 1)[1], None)
    for overload in packet.overloads() if packet is not None else ():
        op = getattr(packet, overload)
        if (
            not op._schema.is_mutable
            and [(a.name, str(a.type)) for a in op._schema.arguments] == inputs
        ):
            return op
    return None


def _refusal(func, default: torch.dtype) -> str:
    return (
        f"{func} cannot run on rgpu under torch.set_default_dtype({default}): its output dtype "
        f"comes from torch's default dtype (now {default}) in a way rgpu cannot reproduce (the "
        "rgpu server keeps float32 as its default). Pass dtype= explicitly, or cast the inputs "
        f"to a floating dtype first (for example x.to({default}))."
    )


def rewrite(dispatch, func, info, args: tuple, kwargs: dict, key, plans: dict, sess) -> Any:
    """The op's result when it depends on the default dtype (sent rewritten), else None: the
    caller then runs it as usual under `key` (which already carries the default dtype)."""
    action = _ACTIONS.get(key)
    if action is None:
        plan = plans.get(key)
        if plan is None:
            plan = plans[key] = infer(func, info, args, kwargs, sess)
        action = _ACTIONS[key] = _classify(
            func, args, kwargs, plan, sess, torch.get_default_dtype()
        )
    kind, payload, want = action
    if kind == _NORMAL:
        return None
    if kind == _REFUSE:
        raise RuntimeError(payload)
    if kind == _ADD_DTYPE:
        args, kwargs = _with_dtype(func, args, kwargs, payload)
    else:
        real, with_bool, outs = payload

        def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            if type(t) is RemoteTensor:
                return dispatch(aten._to_copy.default, (t,), {"dtype": dtype})
            return t.to(dtype)

        args = tuple(_cast_to(a, real, with_bool, cast) for a in args)
        kwargs = {
            k: v if k in outs else _cast_to(v, real, with_bool, cast) for k, v in kwargs.items()
        }
    out = dispatch(func, args, kwargs)
    if _result_dtypes_shapes(out) != want:  # the rewritten op's own plan disagrees: never silent
        raise RuntimeError(_refusal(func, torch.get_default_dtype()))
    return out
