"""Ops rgpu handles itself instead of streaming them: copies between the CPU and rgpu (uploads
and downloads), `.item()`, pinning questions, factories (registered for PrivateUse1, since they
never reach `__torch_dispatch__`), and `repr`."""

from __future__ import annotations

from typing import Any

import torch

from rgpu_protocol import dense_strides

from . import current as _cur
from . import devices as _devices
from . import peer_copy, storage_ids
from . import tensor as _tensor
from .dispatch import dispatch
from .plans import check_session
from .strides import row_major
from .tensor import RemoteTensor

aten = torch.ops.aten


def _session_of(x: RemoteTensor):
    """The session holding `x`: with several servers, not always the current one."""
    if _devices.MULTI and x._r.sess is not None:
        return x._r.sess
    return _cur._current or _cur.current()


def _to_copy(func, info, args, kwargs):
    device = kwargs.get("device")
    if device is not None and torch.device(device).type == "cpu":
        x = args[0]
        if kwargs.get("non_blocking"):
            return _to_cpu_async(x, kwargs)
        out = _session_of(x).download(x)
        dtype = kwargs.get("dtype")
        memory_format = kwargs.get("memory_format")
        if dtype is not None and dtype != out.dtype:
            out = out.to(dtype)
        if memory_format is not None and memory_format != torch.preserve_format:
            out = out.contiguous(memory_format=memory_format)
        if kwargs.get("pin_memory"):
            out = out.pin_memory()
        return out
    if device is not None and torch.device(device).type == "meta":
        # a meta copy has the metadata and no data: PyTorch's ZeroTensor kernels (the zero
        # tangents of torch.func.jvp) work their output shapes out this way
        return func(_tensor.meta_of_key(args[0]._r.key), **kwargs)
    _check_device_index(device)
    if _devices.MULTI and device is not None and torch.device(device).type == _tensor.DEVICE_TYPE:
        target = _devices.index_of(device)
        if _devices.session_of(target, None)[0] is not args[0]._r.sess:
            return peer_copy.to_device(args[0], target, kwargs)  # server to server
    return generic(func, info, args, kwargs)


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
        torch.empty_strided(shape, stride, dtype=x.dtype, device="cpu")
        if dense_strides(shape, stride)
        else torch.empty(shape, dtype=x.dtype, device="cpu")
    )
    return _session_of(x).download_async(x, into=target)


def generic(func, info, args, kwargs):
    """The op's ordinary path, past its special handler."""
    saved = info.special
    info.special = None
    try:
        return dispatch(func, args, kwargs)
    finally:
        info.special = saved


def _check_device_index(device: Any) -> None:
    """A device index past the connected servers' devices is an error on the line that asks."""
    if device is None:
        return
    d = torch.device(device)
    if d.type == _tensor.DEVICE_TYPE and d.index not in (None, 0):
        _cur._current or _cur.current()  # the device count is the servers'
        _devices.check_index(d.index, str(d))


def _copy(func, info, args, kwargs):
    dst, src = args[0], args[1]
    if isinstance(dst, RemoteTensor) and not isinstance(src, RemoteTensor):
        return upload_into(dst, src)
    if isinstance(src, RemoteTensor) and not isinstance(dst, RemoteTensor):
        return _copy_to_cpu(dst, src, bool(kwargs.get("non_blocking", False)))
    if _devices.MULTI and peer_copy.crosses_servers(dst, src):
        return peer_copy.copy_into(dst, src)  # server to server
    return generic(func, info, args, kwargs)


def _copy_to_cpu(dst: torch.Tensor, src: RemoteTensor, non_blocking: bool) -> torch.Tensor:
    sess = _session_of(src)
    if dst.device.type != "cpu":
        raise RuntimeError(f"cannot copy an rgpu tensor to {dst.device} directly; copy to the CPU")
    _tensor.check_copy_fits(dst, src, "from an rgpu tensor")
    if non_blocking:
        sess.download_async(src, into=dst)  # filled on arrival, like a CUDA device-to-host copy
        return dst
    with torch.no_grad():
        dst.copy_(sess.download(src))
    return dst


def upload_into(dst: RemoteTensor, src: torch.Tensor) -> RemoteTensor:
    if isinstance(src, torch.nn.parameter.UninitializedTensorMixin):
        raise RuntimeError(
            "a lazy module's uninitialized parameters and buffers cannot move to rgpu: run one "
            "forward on the CPU first (`model(example_input)`), then move the model"
        )
    if src.device.type != "cpu":
        raise RuntimeError(
            f"cannot copy a {src.device.type} tensor to rgpu directly; move it to the CPU first"
        )
    if src.shape != dst.shape and torch.broadcast_shapes(src.shape, dst.shape) != dst.shape:
        raise RuntimeError(
            f"The size of tensor a ({list(dst.shape)}) must match the size of tensor b ({list(src.shape)}) "
            "for copy_ into an rgpu tensor"
        )
    sess = _session_of(dst)
    check_session(dst, sess)
    if src.numel() == 0:  # the check above made dst empty too: nothing to copy, no message
        return dst
    sess.upload(dst, src)
    return dst


def _local_scalar_dense(func, info, args, kwargs):
    x = args[0]
    return _session_of(x).download(x).item()


def _is_pinned(func, info, args, kwargs):
    return False


def _pin_memory(func, info, args, kwargs):
    """Refused here with the CPU kernel's words (the server would have said it has no
    accelerator to pin for)."""
    raise RuntimeError(f"cannot pin '{args[0].type()}' only dense CPU tensors can be pinned")


def _lift_fresh(func, info, args, kwargs):
    """`lift_fresh` returns its argument (`torch.tensor(...)` ends with it): no message."""
    return args[0]


def _set_storage(func, info, args, kwargs):
    """`t.set_(storage, offset, size, stride)` over a storage that stands for a server storage
    (`x.untyped_storage()`, or torch.load's uploaded bytes): `t` views that server storage."""
    t, storage, *layout = args
    handle = storage_ids.owner(storage) if isinstance(storage, torch.UntypedStorage) else None
    if handle is None:
        raise NotImplementedError(
            "rgpu tensors cannot be pointed at this Storage: it is not the storage of a live "
            "rgpu tensor (a storage does not keep its tensors alive). Use t.set_(other_tensor), "
            "or t.set_(x.untyped_storage(), offset, size, stride) while x lives"
        )
    nbytes = handle.key[4]
    if nbytes % t.element_size():
        raise RuntimeError(
            f"set_: a storage of {nbytes} bytes does not hold whole {t.dtype} elements"
        )
    whole = _tensor.wrap_handle(handle)
    flat = whole.as_strided((nbytes // whole.element_size(),), (1,), 0).view(t.dtype)
    if layout or kwargs:
        offset = layout[0] if layout else kwargs["storage_offset"]
        size = layout[1] if len(layout) > 1 else kwargs["size"]
        stride = layout[2] if len(layout) > 2 else kwargs.get("stride")
        if stride is None:  # `()` is a 0-dim tensor's own
            stride = row_major(tuple(size))
        flat = flat.as_strided(size, stride, offset)
    t.set_(flat)
    storage_ids.alias(t._r, handle)
    return t


def _decomposed(func, info, args, kwargs):
    """`to` with a device reaches __torch_dispatch__ itself (not its `_to_copy`) where autograd is
    excluded, as inside a custom op's body; sent whole, `x.to("cpu")` stayed on rgpu."""
    return func.decompose(*args, **kwargs)


_COMPOSITE = torch._C.DispatchKeySet("CompositeExplicitAutograd")


def _host_composite(func, info, args, kwargs):
    """Ops whose kernel reads CPU arguments and returns a CPU tensor beside device ones:
    `pack_padded_sequence`'s `batch_sizes` must stay on the CPU (PyTorch refuses a
    PackedSequence whose `batch_sizes` is not). Its own kernel runs here, its indexing ops on rgpu."""
    return func.redispatch(_COMPOSITE, *args, **kwargs)


def _made_elsewhere(func, info, args, kwargs):
    """`torch.zeros_like(x, device="cpu")`, `x.new_zeros(n, device="cpu")`: made on the device
    named, from `x`'s metadata, as on CUDA (they stayed on rgpu)."""
    device = kwargs.get("device")
    if device is None or torch.device(device).type == _tensor.DEVICE_TYPE:
        return generic(func, info, args, kwargs)
    return func(_tensor.meta_of_key(args[0]._r.key), *args[1:], **kwargs)


_LIKE = ("empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like",
         "randint_like", "new_empty", "new_empty_strided", "new_zeros", "new_ones", "new_full")  # fmt: skip

HANDLERS = {
    **{
        getattr(getattr(aten, name), overload): _made_elsewhere
        for name in _LIKE
        for overload in getattr(aten, name).overloads()
    },
    aten._pack_padded_sequence.default: _host_composite,
    aten._to_copy.default: _to_copy,
    aten.to.device: _decomposed,
    aten.to.dtype_layout: _decomposed,
    aten.to.other: _decomposed,
    aten.type_as.default: _decomposed,
    aten.copy_.default: _copy,
    aten._local_scalar_dense.default: _local_scalar_dense,
    aten.is_pinned.default: _is_pinned,
    aten._pin_memory.default: _pin_memory,
    aten.lift_fresh.default: _lift_fresh,
    aten.set_.source_Storage: _set_storage,
    aten.set_.source_Storage_storage_offset: _set_storage,
}  # installed into plans.SPECIAL by rgpu._registration


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


def local_scalar_dense(x: torch.Tensor) -> Any:
    """PrivateUse1 `_local_scalar_dense`: `torch.tensor([a, b])` of rgpu scalars reads each with
    Python dispatch excluded, so it reaches the backend's kernel."""
    return _session_of(x).download(x).item()


def copy_from_and_resize(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    if dst.shape != src.shape:
        dst.resize_(src.shape)
    return copy_from(src, dst)


def tensor_repr(t: RemoteTensor) -> str:
    live = t._r.sess is _cur._current or (_devices.MULTI and t._r.sess in _cur.sessions())
    with torch.no_grad():
        data = _session_of(t).download(t) if live else None
    if data is None:
        return f"RemoteTensor(<from an ended rgpu session>, shape={list(t.shape)}, dtype={t.dtype})"
    s = repr(data)
    extra = f", device='{t.device}'"
    if t.grad_fn is not None:
        extra += f", grad_fn=<{type(t.grad_fn).__name__}>"
    elif t.requires_grad:
        extra += ", requires_grad=True"
    return s[:-1] + extra + ")"
