"""What happens when an aten op meets a RemoteTensor: infer outputs locally, queue the op.

Output metadata comes from running the op on meta tensors, cached by (op, input metadata, scalar
arguments) so a repeated op costs a dict lookup. Only these wait for the server: downloads
(`.cpu()`, `.item()`, printing), ops whose output shape depends on the data, and explicit syncs.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

from . import current as _cur
from . import meta_fixes
from . import tensor as _tensor
from .protocol import Kind, TensorMeta, ref_ext
from .session import dense_strides
from .tensor import (
    TRACED,
    Handle,
    RemoteTensor,
    Traced,
    key_of_meta,
    meta_of_key,
    patch_metadata,
    wrap,
    wrap_inner,
    wrap_view,
    wrap_with_id,
)

aten = torch.ops.aten
_META = torch.device("meta")
_TRUE = object()
_FALSE = object()
_DYN = object()  # plan marker: the server must run the op to know its outputs
_LEARN = object()  # plan marker: meta shapes differ by device for this op; ask the server once
_RUN = int(Kind.RUN)
_RUN_DYN = int(Kind.RUN_DYN)
MAX_DYNAMIC_OUTPUTS = 4096

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
        self.special = _SPECIAL.get(func)
        # returns that alias a written argument: (return index, argument position, argument name)
        self.write_rets: list[tuple[int, int, str]] = []
        for i, r in enumerate(rets):
            if r.alias_info is not None and r.alias_info.is_write:
                for j, a in enumerate(schema.arguments):
                    if (
                        a.alias_info is not None
                        and a.alias_info.before_set == r.alias_info.before_set
                    ):
                        self.write_rets.append((i, -1 if a.kwarg_only else j, a.name))
                        break


def _is_tensorish(t: Any) -> bool:
    s = str(t)
    return "Tensor" in s


_INFO: dict[int, OpInfo] = {}
_KEEP: list = []
_PLANS: dict[tuple, Any] = {}  # the plans of the current session's device type
_PLANS_BY_DEVICE: dict[str, dict] = {}
_plans_session: list = [None]
_SPECIAL: dict[Any, Any] = {}


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
    return x  # dtypes, devices, layouts, memory formats, Generators (hashable)


def _check_session(x: Any, sess) -> None:
    if x._r is TRACED:
        raise Traced()
    if x._r.sess is not sess:
        raise RuntimeError(
            "this rgpu tensor belongs to an earlier session that has ended (reconnected or "
            "disconnected); its data is gone. Recreate it in the current session."
        )


def _plan_key(func, info: OpInfo, args: tuple, kwargs: dict, sess) -> tuple:
    parts: list = [info]
    append = parts.append
    by_value = info.by_value
    for a in args:
        t = type(a)
        if t is RemoteTensor:
            h: Handle = a._r
            if h.sess is not sess:
                _check_session(a, sess)
            append(h.key)
        elif t is int:
            append(a)
        else:
            if t is list or t is tuple:
                for y in a:
                    if type(y) is RemoteTensor and y._r.sess is not sess:
                        _check_session(y, sess)
            append(_key(a, by_value))
    if kwargs:
        for k, v in kwargs.items():
            if type(v) is RemoteTensor and v._r.sess is not sess:
                _check_session(v, sess)
            append(k)
            append(_key(v, by_value))
    return tuple(parts)


# -- meta inference ---------------------------------------------------------------------------

_NEW = 0
_SAME = 1
_NONE = 2
_SEQ = 3
_VALUE = 4


class Plan:
    """Cached result of meta inference for one key: how to build the outputs and out ids."""

    __slots__ = ("spec", "patches", "expect", "single_key", "view")

    def __init__(self, spec, patches, expect, single_key, view=False) -> None:
        self.spec = spec  # nested (kind, payload) mirroring the op's result
        self.patches = patches  # ((path, new_key), ...) for inputs whose metadata changed
        self.expect = expect  # list of TensorMeta|None aligned with out ids, or None
        self.single_key = single_key  # fast path: one fresh tensor output with this key
        self.view = view  # outputs are views of argument 0: made locally, nothing is sent


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
            return (_SAME, hit[0])
        return (_NEW, key_of_meta(o))
    if o is None:
        return (_NONE, None)
    if type(o) in (list, tuple):
        return (_SEQ, (type(o), tuple(_spec_of(y, paths) for y in o)))
    return (_VALUE, o)


def _rewrite_meta_error(e: BaseException) -> BaseException:
    msg = str(e)
    msg = msg.replace("device='meta'", "device='rgpu:0'").replace("device=meta", "device=rgpu")
    msg = re.sub(r"\bmeta\b", "rgpu", msg)
    try:
        new = type(e)(msg)
    except Exception:
        new = RuntimeError(msg)
    return new


def _infer(func, info: OpInfo, args: tuple, kwargs: dict, sess) -> Any:
    paths: dict = {}
    memo: dict = {}
    margs = tuple(_to_meta(a, ("a", i), paths, memo) for i, a in enumerate(args))
    mkwargs = {k: _to_meta(v, ("k", k), paths, memo) for k, v in kwargs.items()}
    try:
        out = meta_fixes.run_meta(func, margs, mkwargs, meta_fixes.device_type(sess.device))
    except (NotImplementedError, DynamicOutputShapeException, DataDependentOutputException):
        return _DYN
    except Exception as e:
        if info.dynamic or info.nontensor or "meta tensor" in str(e) or "Meta" in str(e):
            return _DYN
        raise _rewrite_meta_error(e) from None
    if info.nontensor or (info.dynamic and not isinstance(out, (torch.Tensor, list, tuple))):
        return _DYN
    _require_strided(out, func)
    if info.conform and meta_fixes.must_ask_server(func, margs):
        return _DYN if info.write_rets else _LEARN
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
    single = spec[1] if spec[0] == _NEW and not patches and expect is None else None
    return Plan(spec, patches, expect, single)


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
    if kind == _SEQ:
        flat = []
        for child in payload[1]:
            if child[0] == _SEQ:
                flat.extend(c[1] if c[0] == _NEW else None for c in child[1][1])
            else:
                flat.append(child[1] if child[0] == _NEW else None)
        return flat
    return [payload if kind == _NEW else None]


# -- building outputs -------------------------------------------------------------------------


def _at(args: tuple, kwargs: dict, path: tuple) -> Any:
    where, first, *rest = path
    x = args[first] if where == "a" else kwargs[first]
    for i in rest:
        x = x[i]
    return x


def _build(spec: tuple, args: tuple, kwargs: dict, sess, ids: list, depth: int = 0) -> Any:
    kind, payload = spec
    if kind == _NEW:
        w = wrap(sess, payload)
        ids.append(w._r.id)
        return w
    if kind == _SAME:
        ids.append(None)
        return _at(args, kwargs, payload)
    if kind == _NONE:
        ids.append(None)
        return None
    if kind == _SEQ:
        typ, children = payload
        if depth == 0:
            return typ(_build(c, args, kwargs, sess, ids, 1) for c in children)
        return typ(_build(c, args, kwargs, sess, ids, 2) for c in children)
    ids.append(None)
    return payload


def dispatch(func, args: tuple, kwargs: dict | None) -> Any:
    """`__torch_dispatch__` for RemoteTensor, and the body of the factory kernels."""
    info = _INFO.get(id(func))  # OpOverload's __hash__ is Python code; its id is not
    if info is None:
        info = _INFO[id(func)] = OpInfo(func)
        _KEEP.append(func)  # ids stay valid: OpOverloads live for the process anyway
    if kwargs is None:
        kwargs = {}
    if info.special is not None:
        if _any_traced(args, kwargs):
            return run_traced(func, args, kwargs)
        return info.special(func, info, args, kwargs)
    if info.wire is None:
        return _run_non_aten(func, args, kwargs)
    sess = _cur._current or _cur.current()
    try:
        key = _plan_key(func, info, args, kwargs, sess)
    except Traced:
        return run_traced(func, args, kwargs)
    plans = _PLANS if sess is _plans_session[0] else _plans_for(sess)
    plan = plans.get(key)
    if plan is None:
        plan = _infer(func, info, args, kwargs, sess)
        plans[key] = plan
    if plan is _DYN:
        return run_dynamic(func, info, args, kwargs, sess)
    if plan is _LEARN:
        out = run_dynamic(func, info, args, kwargs, sess)
        plans[key] = _plan_from_outputs(out)
        return out
    single = plan.single_key
    if single is not None:
        out = wrap(sess, single)
        sess.post((_RUN, info.wire, args, kwargs or None, [out._r.id]))
        return out
    if plan.view:
        base: Handle = args[0]._r
        kind, payload = plan.spec
        if kind == _NEW:
            return wrap_view(sess, payload, base)
        typ, children = payload
        return typ(wrap_view(sess, c[1], base) for c in children)
    for path, new_key in plan.patches:
        target = _at(args, kwargs, path)
        if target._r.base is not None:
            materialize(target, sess)
        patch_metadata(target, new_key)
    ids: list = []
    out = _build(plan.spec, args, kwargs, sess, ids)
    if plan.expect is None:
        sess.post((_RUN, info.wire, args, kwargs or None, ids))
    else:
        sess.post((_RUN, info.wire, args, kwargs or None, ids, plan.expect))
    return out


def _plans_for(sess) -> dict:
    """Plans predict one kind of device's layouts: a session on another kind gets its own."""
    global _PLANS
    _PLANS = _PLANS_BY_DEVICE.setdefault(meta_fixes.device_type(sess.device), {})
    _plans_session[0] = sess
    return _PLANS


def _run_non_aten(func, args: tuple, kwargs: dict) -> Any:
    """A non-aten op (torch.library custom op, prims): run its Python decomposition, if any.

    The server only runs aten ops, so an op can run on rgpu only when it breaks down into them.
    """
    out = func.decompose(*args, **kwargs)
    if out is not NotImplemented:
        return out
    name = func.name()
    for key in ("CompositeExplicitAutograd", "CompositeExplicitAutogradNonFunctional"):
        if torch._C._dispatch_has_kernel_for_dispatch_key(name, key):
            return func.redispatch(torch._C.DispatchKeySet(key), *args, **kwargs)
    raise NotImplementedError(
        f"rgpu runs aten operators; {func} is not one and has no decomposition into aten "
        "operators, so it cannot run on the rgpu server"
    )


# -- torch.compile tracing ----------------------------------------------------------------------


def _any_traced(args: tuple, kwargs: dict) -> bool:
    return any(
        isinstance(a, RemoteTensor) and a._r is TRACED for a in pytree.tree_leaves((args, kwargs))
    )


def run_traced(func, args: tuple, kwargs: dict) -> Any:
    """An op on tensors torch.compile is tracing: run it on their (fake) inner tensors, send
    nothing. Outputs are traced RemoteTensors; an op that returns an input returns its wrapper."""
    inner_of: dict[int, RemoteTensor] = {}

    def unwrap(x: Any) -> Any:
        if isinstance(x, RemoteTensor):
            m = x._rgpu_meta
            inner_of[id(m)] = x
            return m
        return x

    out = func(*pytree.tree_map(unwrap, args), **pytree.tree_map(unwrap, kwargs))

    def wrap_out(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            same = inner_of.get(id(x))
            return same if same is not None else wrap_inner(x)
        return x

    return pytree.tree_map(wrap_out, out)


def materialize(w: RemoteTensor, sess) -> None:
    """Give a lazy view its own server entry (before an op changes its metadata in place)."""
    h = w._r
    if h.base is None:
        return
    tid = _tensor.next_id()
    sess.post((_RUN, "alias.default", [w], None, [tid]))
    h.id = tid
    h.base = None
    h.ext = ref_ext(tid)


# -- ops that need the server's answer --------------------------------------------------------


def run_dynamic(func, info: OpInfo, args: tuple, kwargs: dict, sess) -> Any:
    """Run an op whose outputs only the data determines: one wait, then outputs stream on."""
    first_id = _tensor.next_id()
    for _ in range(MAX_DYNAMIC_OUTPUTS):  # reserve a block of ids for the server to fill in order
        _tensor.next_id()

    def free_unclaimed(status, values) -> None:  # the caller was interrupted before the reply
        if type(values) is list:
            n = sum(type(v) is TensorMeta for v in values)
            sess.frees.extend(range(first_id, first_id + n))
            sess.kick()

    values = sess.request(
        (_RUN_DYN, info.wire, args, kwargs or None, first_id), on_abandoned=free_unclaimed
    )
    flat = []
    tid = first_id
    for v in values:
        if type(v) is TensorMeta:
            key = (
                v.dtype,
                tuple(v.shape),
                tuple(v.stride),
                v.offset,
                _span_bytes(v),
                (1 if v.conj else 0) | (2 if v.neg else 0),
            )
            flat.append(wrap_with_id(sess, key, tid))
            tid += 1
        else:
            flat.append(v)
    # a written argument (out=, in-place) comes back as itself, with its new metadata
    for ret_index, pos, name in info.write_rets:
        target = args[pos] if 0 <= pos < len(args) else kwargs.get(name)
        if (
            isinstance(target, RemoteTensor)
            and ret_index < len(flat)
            and isinstance(flat[ret_index], RemoteTensor)
        ):
            patch_metadata(target, flat[ret_index]._r.key)
            flat[ret_index] = target
    if info.nret == 1:
        ret = func._schema.returns[0]
        if str(ret.type).startswith("List") or "[]" in str(ret.type):
            return list(flat)
        return flat[0] if flat else None
    if info.nret == 0:
        return None
    return tuple(flat)


def _plan_from_outputs(out: Any) -> Plan:
    """A streaming plan that reproduces the layouts the server just produced for this key."""

    def spec(o: Any) -> tuple:
        if isinstance(o, RemoteTensor):
            return (_NEW, o._r.key)
        if type(o) in (list, tuple):
            return (_SEQ, (type(o), tuple(spec(y) for y in o)))
        return (_NONE, None) if o is None else (_VALUE, o)

    s = spec(out)
    expect = [
        TensorMeta(k[0], k[1], k[2], k[3], bool(k[5] & 1), bool(k[5] & 2))
        if k is not None
        else None
        for k in _flat_new_keys(s)
    ]
    return Plan(s, (), expect, None)


def _span_bytes(v: TensorMeta) -> int:
    if all(s > 0 for s in v.shape):
        span = v.offset + sum((s - 1) * st for s, st in zip(v.shape, v.stride)) + 1
    else:
        span = v.offset
    return span * v.dtype.itemsize


def _to_copy(func, info, args, kwargs):
    device = kwargs.get("device")
    if device is not None and torch.device(device).type == "cpu":
        x = args[0]
        if kwargs.get("non_blocking"):
            return _to_cpu_async(x, kwargs)
        out = (_cur._current or _cur.current()).download(x)
        dtype = kwargs.get("dtype")
        memory_format = kwargs.get("memory_format")
        if dtype is not None and dtype != out.dtype:
            out = out.to(dtype)
        if memory_format is not None and memory_format != torch.preserve_format:
            out = out.contiguous(memory_format=memory_format)
        if kwargs.get("pin_memory"):
            out = out.pin_memory()
        return out
    _check_device_index(device)
    return _generic(func, info, args, kwargs)


def _to_cpu_async(x: RemoteTensor, kwargs: dict) -> torch.Tensor:
    """`x.to("cpu", non_blocking=True)`: a CPU tensor now, its values once the reply lands.

    As with CUDA, read it after `torch.rgpu.synchronize()` or an `rgpu.Event` recorded later;
    a dtype or layout change runs on the server first, so the readback itself stays one copy.
    """
    dtype = kwargs.get("dtype")
    memory_format = kwargs.get("memory_format")
    if (dtype is not None and dtype != x.dtype) or (
        memory_format is not None and memory_format != torch.preserve_format
    ):
        x = dispatch(aten._to_copy.default, (x,), {"dtype": dtype, "memory_format": memory_format})
    shape, stride = tuple(x.shape), x.stride()
    target = (
        torch.empty_strided(shape, stride, dtype=x.dtype)
        if dense_strides(shape, stride)
        else torch.empty(shape, dtype=x.dtype)
    )
    return (_cur._current or _cur.current()).download_async(x, into=target)


def _generic(func, info, args, kwargs):
    saved = info.special
    info.special = None
    try:
        return dispatch(func, args, kwargs)
    finally:
        info.special = saved


def _check_device_index(device: Any) -> None:
    if device is None:
        return
    d = torch.device(device)
    if d.type == _tensor.DEVICE_TYPE and d.index not in (None, 0):
        raise RuntimeError(f"rgpu has one device, rgpu:0; {d} does not exist")


def _copy(func, info, args, kwargs):
    dst, src = args[0], args[1]
    if isinstance(dst, RemoteTensor) and not isinstance(src, RemoteTensor):
        return upload_into(dst, src)
    if isinstance(src, RemoteTensor) and not isinstance(dst, RemoteTensor):
        return _copy_to_cpu(dst, src, bool(kwargs.get("non_blocking", False)))
    return _generic(func, info, args, kwargs)


def _copy_to_cpu(dst: torch.Tensor, src: RemoteTensor, non_blocking: bool) -> torch.Tensor:
    sess = _cur._current or _cur.current()
    if dst.device.type != "cpu":
        raise RuntimeError(f"cannot copy an rgpu tensor to {dst.device} directly; copy to the CPU")
    try:
        fits = torch.broadcast_shapes(src.shape, dst.shape) == dst.shape
    except RuntimeError:
        fits = False
    if not fits:
        raise RuntimeError(
            f"The size of tensor a ({list(dst.shape)}) must match the size of tensor b "
            f"({list(src.shape)}) for copy_ from an rgpu tensor"
        )
    if non_blocking:
        sess.download_async(src, into=dst)  # filled on arrival, like a CUDA device-to-host copy
        return dst
    with torch.no_grad():
        dst.copy_(sess.download(src))
    return dst


def upload_into(dst: RemoteTensor, src: torch.Tensor) -> RemoteTensor:
    if src.device.type != "cpu":
        raise RuntimeError(
            f"cannot copy a {src.device.type} tensor to rgpu directly; move it to the CPU first"
        )
    if torch.broadcast_shapes(src.shape, dst.shape) != dst.shape:
        raise RuntimeError(
            f"The size of tensor a ({list(dst.shape)}) must match the size of tensor b ({list(src.shape)}) "
            "for copy_ into an rgpu tensor"
        )
    sess = _cur._current or _cur.current()
    _check_session(dst, sess)
    sess.upload(dst, src)
    return dst


def _local_scalar_dense(func, info, args, kwargs):
    x = args[0]
    sess = _cur._current or _cur.current()
    return sess.download(x).item()


def _is_pinned(func, info, args, kwargs):
    return False


def _set_storage(func, info, args, kwargs):
    raise NotImplementedError(
        "rgpu tensors cannot be pointed at a raw Storage; use set_(other_tensor)"
    )


_SPECIAL.update(
    {
        aten._to_copy.default: _to_copy,
        aten.copy_.default: _copy,
        aten._local_scalar_dense.default: _local_scalar_dense,
        aten.is_pinned.default: _is_pinned,
        aten.set_.source_Storage: _set_storage,
        aten.set_.source_Storage_storage_offset: _set_storage,
    }
)


# -- factory kernels (registered for PrivateUse1: factories never reach __torch_dispatch__) ----


def factory(func):
    def kernel(*args, **kwargs):
        _check_device_index(kwargs.get("device"))
        if kwargs.get("pin_memory"):
            raise RuntimeError("rgpu tensors cannot be pinned; pin_memory applies to CPU tensors")
        return dispatch(func, args, kwargs)

    return kernel


def copy_from(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """PrivateUse1 `_copy_from`: torch.tensor(data, device="rgpu") and friends land here."""
    if isinstance(dst, RemoteTensor) and not isinstance(src, RemoteTensor):
        return upload_into(dst, src)
    if isinstance(src, RemoteTensor) and not isinstance(dst, RemoteTensor):
        return _copy_to_cpu(dst, src, non_blocking)
    return dispatch(aten.copy_.default, (dst, src), {})


def copy_from_and_resize(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    if dst.shape != src.shape:
        dst.resize_(src.shape)
    return copy_from(src, dst)


def tensor_repr(t: RemoteTensor) -> str:
    with torch.no_grad():
        data = (_cur._current or _cur.current()).download(t) if t._r.sess is _cur._current else None
    if data is None:
        return f"RemoteTensor(<from an ended rgpu session>, shape={list(t.shape)}, dtype={t.dtype})"
    s = repr(data)
    extra = f", device='{t.device}'"
    if t.grad_fn is not None:
        extra += f", grad_fn=<{type(t.grad_fn).__name__}>"
    elif t.requires_grad:
        extra += ", requires_grad=True"
    return s[:-1] + extra + ")"


_tensor._dispatch = dispatch
