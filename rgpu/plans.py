"""What the client knows about an op before sending it: its `OpInfo` (from the schema, once per
overload) and its `Plan` (from meta inference, once per op and input layouts).

Output metadata comes from running the op on meta tensors, cached by (op, input metadata, scalar
arguments), so a repeated op costs a dict lookup. A plan may instead say that the server must be
asked (`DYN`: the data decides; `LEARN`: the meta kernel's layout is not the device's).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

from rgpu_protocol import TensorMeta, written_returns

from . import fast_meta, in_place_meta, meta_checks, meta_fixes, same_device, shared_memory
from . import tensor as _tensor
from .errors import shown_briefly
from .tensor import (
    TRACED,
    Handle,
    RemoteTensor,
    Traced,
    key_of_meta,
    meta_of_key,
)

aten = torch.ops.aten
_META = torch.device("meta")
_TRUE = object()
_FALSE = object()
DYN = object()  # plan marker: the server must run the op to know its outputs
LEARN = object()  # plan marker: meta shapes differ by device for this op; ask the server once

# Ops whose output *shape* depends on float argument values: key those by value, not by type.
_FLOAT_SHAPE_OPS = re.compile(
    r"^(arange|range|linspace|logspace|_?upsample_\w+|histc|_histogramdd\w*)$"
)


class OpInfo:
    """What the client needs to know about one OpOverload, computed once."""

    __slots__ = (
        "wire",
        "by_value",
        "dynamic",
        "nontensor",
        "conform",
        "special",
        "composite",
        "view_op",
        "nret",
        "write_rets",
    )

    def __init__(self, func: torch._ops.OpOverload) -> None:
        schema = func._schema
        ns, name = schema.name.split("::", 1)
        self.wire = f"{name}.{func._overloadname}" if ns == "aten" else None
        self.by_value = bool(_FLOAT_SHAPE_OPS.match(name))
        tags = func.tags
        self.dynamic = (
            torch.Tag.dynamic_output_shape in tags or torch.Tag.data_dependent_output in tags
        )
        rets = schema.returns
        self.nret = len(rets)
        self.nontensor = bool(rets) and not any(_is_tensorish(r.type) for r in rets)
        self.conform = meta_fixes.may_ask_server(name)  # outputs only the server can lay out
        self.special = SPECIAL.get(func)
        self.view_op = func.is_view  # its outputs alias argument 0
        # a CompositeImplicitAutograd op that reached the device itself: autograd's kernel, which
        # breaks it up (or sends it whole: rgpu.whole_ops), was skipped (inference mode, the body
        # of a custom op); it is handled as autograd's kernel would have (COMPOSITE, else `_break_up`)
        self.composite = None
        if self.special is None and ns == "aten":
            self.composite = COMPOSITE.get(func)
            if self.composite is None and torch._C._dispatch_has_kernel_for_dispatch_key(
                func.name(), "CompositeImplicitAutograd"
            ):
                self.composite = _break_up
        # returns that alias a written argument: (return index, argument position, argument name)
        self.write_rets = written_returns(schema)


def _is_tensorish(t: Any) -> bool:
    s = str(t)
    return "Tensor" in s


_IMPLICIT = torch._C.DispatchKey.CompositeImplicitAutograd


def _break_up(func, args: tuple, kwargs: dict) -> Any:
    """PyTorch's C++ formula for a composite op, as autograd's kernel runs it (the meta kernel of
    the composite as a whole may lay its output out differently from the device: conv2d of a
    channels-last input under inference mode came back contiguous here, channels-last there)."""
    return func._op_dk(_IMPLICIT, *args, **kwargs)


INFO: dict[int, OpInfo] = {}
KEEP: list = []
PLANS_BY_DEVICE: dict[str, dict] = {}  # plan key -> plan, per kind of server device
CURRENT_PLANS: list = [None, {}]  # [session, its device type's plans]: the hot path's cache
SPECIAL: dict[Any, Any] = {}  # op -> handler, filled by rgpu._registration
# composite op -> (func, args, kwargs) -> result, or NotImplemented to send it whole; filled by
# rgpu._registration for the composites autograd's kernel sends whole (rgpu.whole_ops, attention)
COMPOSITE: dict[Any, Any] = {}


# -- cache keys -------------------------------------------------------------------------------


def _key(x: Any, by_value: bool) -> Any:
    t = type(x)
    if t is RemoteTensor:
        return x._r.key
    if t is int or t is str or x is None:
        return x
    if t is float:
        return (float, x) if by_value else float  # (float, 10.0) must not equal the int 10
    if t is bool:
        return _TRUE if x else _FALSE
    if t is list or t is tuple:
        return tuple([_key(y, by_value) for y in x])
    if isinstance(x, torch.Tensor):
        if isinstance(x, RemoteTensor):
            return x._r.key
        return ("host", x.device.type, x.dtype, tuple(x.shape), x.stride(), x.is_conj(), x.is_neg())
    if t is complex:
        return (complex, x) if by_value else complex
    if t is torch._C.Generator:  # a new wrapper each call; no part of the output's layout
        return t
    return x  # dtypes, devices, layouts, memory formats (hashable)


def check_session(x: Any, sess) -> None:
    if x._r is TRACED:
        raise Traced()
    if x._r.sess is not sess:
        raise RuntimeError(
            "this rgpu tensor belongs to an earlier session that has ended (reconnected or "
            "disconnected); its data is gone. Recreate it in the current session."
        )


def plan_key(func, info: OpInfo, args: tuple, kwargs: dict, sess) -> tuple:
    parts: list = [info]
    append = parts.append
    by_value = info.by_value
    for a in args:
        t = type(a)
        if t is RemoteTensor:
            h: Handle = a._r
            if h.sess is not sess:
                check_session(a, sess)
            append(h.key)
        elif t is int:
            append(a)
        else:
            if t is list or t is tuple:
                for y in a:
                    if type(y) is RemoteTensor and y._r.sess is not sess:
                        check_session(y, sess)
            append(_key(a, by_value))
    if kwargs:
        for k, v in kwargs.items():
            if type(v) is RemoteTensor and v._r.sess is not sess:
                check_session(v, sess)
            append(k)
            append(_key(v, by_value))
    return tuple(parts)


# -- meta inference ---------------------------------------------------------------------------

NEW = 0
SAME = 1
NONE = 2
SEQ = 3
VALUE = 4


class Plan:
    """Cached result of meta inference for one key: how to build the outputs and out ids."""

    __slots__ = ("spec", "patches", "expect", "single_key", "view", "dense", "shared")

    def __init__(self, spec, patches, expect, single_key, view=False) -> None:
        self.spec = spec  # nested (kind, payload) mirroring the op's result
        self.patches = patches  # ((path, new_key), ...) for inputs whose metadata changed
        self.expect = expect  # list of TensorMeta|None aligned with out ids, or None
        self.single_key = single_key  # fast path: one fresh tensor output with this key
        self.view = view  # outputs are views of argument 0: made locally, nothing is sent
        # the single output is a plain contiguous tensor (`wrap_dense` makes it)
        self.dense = single_key is not None and _tensor.is_dense_key(single_key)
        # (written, read) argument pairs whose memory may be shared (rgpu.shared_memory)
        self.shared: tuple | None = None


def _to_meta(x: Any, path: tuple, paths: dict, memo: dict) -> Any:
    t = type(x)
    if t is RemoteTensor:
        m = memo.get(id(x))
        if m is None:
            m = meta_of_key(x._r.key)
            memo[id(x)] = m
            paths[id(m)] = (path, m, x._r.key)
        return m
    if t is list or t is tuple:
        return t(_to_meta(y, path + (i,), paths, memo) for i, y in enumerate(x))
    if t is torch.device and x.type == _tensor.DEVICE_TYPE:
        return _META
    if t is torch.Tensor and x.device.type == "cpu" and x.dim() == 0:
        # a CPU scalar beside device tensors: CUDA kernels take it as a number, and so do the
        # Python meta kernels of an accelerator, but not of "meta" (`masked_fill(m, cpu0d)`,
        # `cpu0d // t`, `copysign`, `index_fill_` raised "expected ... the same device")
        return torch.empty((), dtype=x.dtype, device=_META)
    if t is torch._C.Generator:  # the refs' meta kernels refuse one; no part of the layout
        return None
    return x


def _require_strided(o: Any, func) -> None:
    if isinstance(o, torch.Tensor):
        if o.layout != torch.strided:
            raise NotImplementedError(
                f"{func} would make a {o.layout} tensor; rgpu supports dense (strided) tensors only"
            )
    elif type(o) in (list, tuple):
        for y in o:
            _require_strided(y, func)


def _spec_of(o: Any, paths: dict) -> tuple:
    if isinstance(o, torch.Tensor):
        hit = paths.get(id(o))
        if hit is not None:
            return (SAME, hit[0])
        return (NEW, key_of_meta(o))
    if o is None:
        return (NONE, None)
    if type(o) in (list, tuple):
        return (SEQ, (type(o), tuple(_spec_of(y, paths) for y in o)))
    return (VALUE, o)


def _rewrite_meta_error(e: BaseException) -> BaseException:
    msg = str(e)
    msg = msg.replace("device='meta'", "device='rgpu:0'").replace("device=meta", "device=rgpu")
    msg = re.sub(r"\bmeta\b", "rgpu", msg)
    try:
        new = type(e)(msg)
    except Exception:
        new = RuntimeError(msg)
    return shown_briefly(new)


def infer(func, info: OpInfo, args: tuple, kwargs: dict, sess) -> Any:
    same_device.check(func, info.wire, args, kwargs)
    meta_checks.check(func, args, kwargs)
    paths: dict = {}
    memo: dict = {}
    margs = tuple(_to_meta(a, ("a", i), paths, memo) for i, a in enumerate(args))
    mkwargs = {k: _to_meta(v, ("k", k), paths, memo) for k, v in kwargs.items()}
    try:
        if info.write_rets:
            in_place_meta.check_result_type(func, margs, mkwargs)
        out = fast_meta.run(func, margs, mkwargs)
        if out is None:
            out = meta_fixes.run_meta(func, margs, mkwargs, meta_fixes.device_type(sess.device))
    except (NotImplementedError, DynamicOutputShapeException, DataDependentOutputException):
        return DYN
    except Exception as e:
        if info.dynamic or info.nontensor or "meta tensor" in str(e) or "Meta" in str(e):
            return DYN
        raise _rewrite_meta_error(e) from None
    if info.nontensor or (info.dynamic and not isinstance(out, (torch.Tensor, list, tuple))):
        return DYN
    if info.write_rets and _writes_overlapping(info, margs, mkwargs):
        return DYN
    _require_strided(out, func)
    if info.conform and meta_fixes.must_ask_server(func, margs):
        return DYN if info.write_rets else LEARN
    spec = _spec_of(out, paths)
    patches = tuple(
        (path, key_of_meta(m)) for path, m, key in paths.values() if key_of_meta(m) != key
    )
    if not patches and _views_of_first_arg(out, margs):
        return Plan(spec, (), None, None, view=True)
    expect = None
    if sess.check_meta:
        expect = [TensorMeta(k[0], k[1], k[2], k[3], bool(k[5] & 1), bool(k[5] & 2)) if k is not None else None
                  for k in _flat_new_keys(spec)]  # fmt: skip
    single = spec[1] if spec[0] == NEW and not patches and expect is None else None
    plan = Plan(spec, patches, expect, single)
    if info.write_rets:
        plan.shared = shared_memory.pairs_to_check(info.write_rets, args, kwargs)
    return plan


def _writes_overlapping(info: OpInfo, margs: tuple, mkwargs: dict) -> bool:
    """True when a tensor the op writes has elements that share memory (an `expand`ed one).
    Most kernels refuse that before writing, as meta kernels do not: run synchronously, the
    server's refusal is raised at the op, as on the CPU, and the tensor is left intact instead
    of poisoned by a failure found later. (fill_, masked_fill_ and a few others accept it.)"""
    for _, pos, name in info.write_rets:
        m = margs[pos] if 0 <= pos < len(margs) else mkwargs.get(name)
        if isinstance(m, torch.Tensor) and torch._debug_has_internal_overlap(m) == 1:
            return True
    return False


def _views_of_first_arg(out: Any, margs: tuple) -> bool:
    """True when every output is a fresh view over argument 0's storage, in the same dtype and
    without conj/neg bits: then `base.as_strided(...)` on the server reproduces it exactly."""
    if not margs or not isinstance(margs[0], torch.Tensor) or margs[0].device.type != "meta":
        return False
    base = margs[0]
    if base.is_conj() or base.is_neg():
        return False
    storage = base.untyped_storage()._cdata
    outs = out if type(out) in (list, tuple) else (out,)
    if not outs:
        return False
    for o in outs:
        if (
            not isinstance(o, torch.Tensor)
            or o is base
            or o.untyped_storage()._cdata != storage
            or o.dtype != base.dtype
            or o.is_conj()
            or o.is_neg()
        ):
            return False
    return True


def _flat_new_keys(spec: tuple) -> list:
    """Keys of fresh outputs (None elsewhere), flattened like the server flattens results."""
    kind, payload = spec
    if kind == SEQ:
        flat = []
        for child in payload[1]:
            if child[0] == SEQ:
                flat.extend(c[1] if c[0] == NEW else None for c in child[1][1])
            else:
                flat.append(child[1] if child[0] == NEW else None)
        return flat
    return [payload if kind == NEW else None]


def plan_from_outputs(out: Any) -> Plan:
    """A streaming plan that reproduces the layouts the server just produced for this key."""

    def spec(o: Any) -> tuple:
        if isinstance(o, RemoteTensor):
            return (NEW, o._r.key)
        if type(o) in (list, tuple):
            return (SEQ, (type(o), tuple(spec(y) for y in o)))
        return (NONE, None) if o is None else (VALUE, o)

    s = spec(out)
    expect = [
        TensorMeta(k[0], k[1], k[2], k[3], bool(k[5] & 1), bool(k[5] & 2))
        if k is not None
        else None
        for k in _flat_new_keys(s)
    ]
    return Plan(s, (), expect, None)


def plans_for(sess) -> dict:
    """Plans predict one kind of device's layouts: a session on another kind gets its own."""
    plans = PLANS_BY_DEVICE.setdefault(meta_fixes.device_type(sess.device), {})
    CURRENT_PLANS[:] = [sess, plans]
    return plans
