"""What happens when an aten op meets a RemoteTensor: infer outputs locally, queue the op.

Output metadata comes from the op's plan (rgpu.plans). Only these wait for the server: downloads
(`.cpu()`, `.item()`, printing), ops whose output shape depends on the data, and explicit syncs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from rgpu_protocol import MAX_DYNAMIC_OUTPUTS, Kind, TensorMeta, ref_ext

from . import current as _cur
from . import default_dtype as _default_dtype
from . import devices as _devices
from . import keys as _keys
from . import shared_memory as _shared_memory
from . import storage_ids as _storage_ids
from . import tensor as _tensor
from .plans import (
    CURRENT_PLANS,
    DYN,
    INFO,
    KEEP,
    LEARN,
    NEW,
    NONE,
    SAME,
    SEQ,
    OpInfo,
    infer,
    plan_from_outputs,
    plan_key,
    plans_for,
)
from .tensor import (
    TRACED,
    Handle,
    RemoteTensor,
    Traced,
    key_of_tensor_meta,
    patch_metadata,
    wrap,
    wrap_dense,
    wrap_inner,
    wrap_view,
    wrap_with_id,
)

_RUN = int(Kind.RUN)
_default = torch.get_default_dtype
_FLOAT32 = torch.float32
_RUN_DYN = int(Kind.RUN_DYN)


# -- building outputs -------------------------------------------------------------------------


def _at(args: tuple, kwargs: dict, path: tuple) -> Any:
    where, first, *rest = path
    x = args[first] if where == "a" else kwargs[first]
    for i in rest:
        x = x[i]
    return x


def _build(
    spec: tuple, args: tuple, kwargs: dict, sess, ids: list, depth: int = 0, dev: int = 0
) -> Any:
    kind, payload = spec
    if kind == NEW:
        w = wrap(sess, payload, dev)
        ids.append(w._r.id)
        return w
    if kind == SAME:
        ids.append(None)
        return _at(args, kwargs, payload)
    if kind == NONE:
        ids.append(None)
        return None
    if kind == SEQ:
        typ, children = payload
        if depth == 0:
            return typ(_build(c, args, kwargs, sess, ids, 1, dev) for c in children)
        return typ(_build(c, args, kwargs, sess, ids, 2, dev) for c in children)
    ids.append(None)
    return payload


def dispatch(func, args: tuple, kwargs: dict | None) -> Any:
    """`__torch_dispatch__` for RemoteTensor, and the body of the factory kernels."""
    info = INFO.get(id(func))  # OpOverload's __hash__ is Python code; its id is not
    if info is None:
        info = INFO[id(func)] = OpInfo(func)
        KEEP.append(func)  # ids stay valid: OpOverloads live for the process anyway
    if kwargs is None:
        kwargs = {}
    if info.special is not None:
        if _any_traced(args, kwargs):
            return run_traced(func, args, kwargs)
        return info.special(func, info, args, kwargs)
    if info.wire is None:
        if _any_traced(args, kwargs):
            return _trace_non_aten(func, args, kwargs)
        return _run_non_aten(func, args, kwargs)
    if info.composite is not None:
        out = info.composite(func, args, kwargs)
        if out is not NotImplemented:
            return out
    if info.view_op and torch.is_inference_mode_enabled() and _normal_tensor(args):
        # a view of a normal tensor is a normal tensor, as on the CPU: made under inference
        # mode, autograd's view bookkeeping refused it ("Cannot set version_counter")
        with torch.inference_mode(False):
            return dispatch(func, args, kwargs)
    sess = _cur._current or _cur.current()
    dev = 0
    where = None  # with several devices: the op's device on its server (rgpu.devices)
    if _devices.MULTI:
        sess, dev, where = _devices.route(func, args, kwargs, sess)
    try:
        key = plan_key(func, info, args, kwargs, sess)
    except Traced:
        return run_traced(func, args, kwargs)
    plans = CURRENT_PLANS[1] if sess is CURRENT_PLANS[0] else plans_for(sess)
    if _default() is not _FLOAT32:  # the server's default stays float32
        key = (key, _default())
        out = _default_dtype.rewrite(dispatch, func, info, args, kwargs, key, plans, sess)
        if out is not None:
            return out
    plan = plans.get(key)
    if plan is None:
        plan = infer(func, info, args, kwargs, sess)
        plans[key] = plan
    if plan is DYN:
        return run_dynamic(func, info, args, kwargs, sess, dev, where)
    if plan is LEARN:
        out = run_dynamic(func, info, args, kwargs, sess, dev, where)
        plans[key] = plan_from_outputs(out)
        return out
    if plan.shared is not None and _shared_memory.overlap(plan.shared, args, kwargs):
        return run_dynamic(func, info, args, kwargs, sess, dev, where)  # the kernel decides
    single = plan.single_key
    if single is not None:
        out = wrap_dense(sess, single, dev) if plan.dense else wrap(sess, single, dev)
        sess.post((_RUN, info.wire, args, kwargs or None, [out._r.id]), device=where)
        if info.view_op:  # a view the server makes (of another dtype): the same storage
            _storage_ids.alias(out._r, args[0]._r)
        return out
    if plan.view:
        base: Handle = args[0]._r
        kind, payload = plan.spec
        if kind == NEW:
            return wrap_view(sess, payload, base)
        typ, children = payload
        return typ(wrap_view(sess, c[1], base) for c in children)
    for path, new_key in plan.patches:
        target = _at(args, kwargs, path)
        if target._r.base is not None:
            materialize(target, sess, where)
        patch_metadata(target, new_key)
    ids: list = []
    out = _build(plan.spec, args, kwargs, sess, ids, 0, dev)
    if plan.expect is None:
        sess.post((_RUN, info.wire, args, kwargs or None, ids), device=where)
    else:
        sess.post((_RUN, info.wire, args, kwargs or None, ids, plan.expect), device=where)
    return out


def _normal_tensor(args: tuple) -> bool:
    return bool(args) and isinstance(args[0], torch.Tensor) and not args[0].is_inference()


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


def _trace_non_aten(func, args: tuple, kwargs: dict) -> Any:
    """A non-aten op under torch.compile: traced through its Python body where that body is
    aten ops (the graph can ship); a body that reads data (a `tolist()` of offsets, as
    transformers' grouped-mm fallback does) is traced as the op itself through its fake kernel,
    and its graph then runs as eager remote ops."""
    try:
        return _run_non_aten(func, args, kwargs)
    except Exception:
        return run_traced(func, args, kwargs)


def _any_traced(args: Any, kwargs: dict | None = None) -> bool:
    # aten arguments nest one level at most (Tensor[], Tensor?[]): no pytree walk, which cost
    # more than the rest of a small upload
    for a in args:
        if isinstance(a, RemoteTensor):
            if a._r is TRACED:
                return True
        elif (type(a) is list or type(a) is tuple) and _any_traced(a):
            return True
    return bool(kwargs) and _any_traced(tuple(kwargs.values()))


def run_traced(func, args: tuple, kwargs: dict) -> Any:
    """An op on tensors torch.compile is tracing: run it on their (fake) inner tensors, send
    nothing. Outputs are traced RemoteTensors; an op that returns an input returns its wrapper."""
    inner_of: dict[int, RemoteTensor] = {}

    def unwrap(x: Any) -> Any:
        if isinstance(x, RemoteTensor):
            m = x._rgpu_meta
            if type(m) is torch.Tensor and m.is_meta:
                raise _ran_locally(func)
            inner_of[id(m)] = x
            return m
        return x

    out = func(*pytree.tree_map(unwrap, args), **pytree.tree_map(unwrap, kwargs))
    for w in inner_of.values():  # `t_`, `unsqueeze_`, out= resizes: the wrapper follows its inner
        m = w._rgpu_meta
        if (
            w.shape != m.shape
            or w.stride() != m.stride()
            or w.storage_offset() != m.storage_offset()
        ):
            _tensor.relayout(w, _keys.key_of_meta(m))

    def wrap_out(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            same = inner_of.get(id(x))
            return same if same is not None else wrap_inner(x)
        return x

    return pytree.tree_map(wrap_out, out)


def _ran_locally(func) -> RuntimeError:
    """A compiled graph run here on rgpu tensors' metadata: its outputs hold no data."""
    return RuntimeError(
        f"{func} met the output of a compiled graph that ran on this machine, where rgpu tensors "
        "have no data: the torch.compile backend used runs AOTAutograd graphs locally "
        "('aot_eager', a custom one). Use the default backend, backend='rgpu' or "
        "backend=rgpu.compile_backend(), which run the graph on the rgpu server"
    )


def materialize(w: RemoteTensor, sess, where: int | None = None) -> None:
    """Give a lazy view its own server entry (before an op changes its metadata in place)."""
    h = w._r
    if h.base is None:
        return
    tid = _tensor.next_id()
    sess.post((_RUN, "alias.default", [w], None, [tid]), device=where)
    _storage_ids.alias(h, h.base)
    h.id = tid
    h.base = None
    h.ext = ref_ext(tid)


# -- ops that need the server's answer --------------------------------------------------------


def run_dynamic(
    func, info: OpInfo, args: tuple, kwargs: dict, sess, dev: int = 0, where: int | None = None
) -> Any:
    """Run an op whose outputs only the data determines: one wait, then outputs stream on."""
    first_id = _tensor.reserve_ids(MAX_DYNAMIC_OUTPUTS)  # the server fills them in order

    def free_unclaimed(status, values) -> None:  # the caller was interrupted before the reply
        if type(values) is list:
            n = sum(type(v) is TensorMeta for v in values)
            sess.frees.extend(range(first_id, first_id + n))
            sess.kick()

    values = sess.request(
        (_RUN_DYN, info.wire, args, kwargs or None, first_id),
        on_abandoned=free_unclaimed,
        device=where,
    )
    flat = []
    tid = first_id
    for v in values:
        if type(v) is TensorMeta:
            key = key_of_tensor_meta(v)
            flat.append(wrap_with_id(sess, key, tid, dev))
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
