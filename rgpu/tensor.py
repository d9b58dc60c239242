"""`RemoteTensor`: a tensor whose data lives on the server, and the handle that frees it.

A RemoteTensor holds no data. Its sizes, strides, offset and dtype are the real ones (kept on the
wrapper itself, so `.shape` costs nothing), and `_r` is a `Handle`: the server-side id, the
session it belongs to, and a hashable metadata key used by the dispatch cache.
"""

from __future__ import annotations

import itertools
import struct
import threading
import traceback
from collections.abc import Callable
from typing import Any

import msgpack
import torch
from torch.utils._mode_utils import no_dispatch

from rgpu_protocol import EXT_REF, ref_ext, view_ext

from . import backward_errors, storage_ids
from .keys import (  # noqa: F401  (re-exported: the layout keys are used with the wrappers)
    check_copy_fits,
    is_dense_key,
    key_of_meta,
    key_of_tensor_meta,
    meta_of_key,
    new_storage_key,
)

_new_ext = tuple.__new__
_DATA = torch._C.TensorBase.data  # the C getter and setter behind `Tensor.data`
_UNTYPED_STORAGE = torch._C.TensorBase.untyped_storage  # the wrapper's own, holding no data
_DATA_PTR = torch._C.TensorBase.data_ptr
_ExtType = msgpack.ExtType
_pack_id = struct.Struct("<Q").pack

Session = Any  # an rgpu.session.Session (not imported here: the session imports this module)

DEVICE_TYPE = "rgpu"
_ids = itertools.count(1)
next_id = _ids.__next__
# Blocks of ids the server fills in order (the outputs of a data-dependent op, the tensors of a
# loaded file) come from a range of their own, far above what next_id will ever reach.
_blocks = [1 << 62]
_blocks_lock = threading.Lock()


def reserve_ids(n: int) -> int:
    """The first of `n` consecutive ids no other tensor will get."""
    with _blocks_lock:
        first = _blocks[0]
        _blocks[0] += n
    return first


# A metadata key: (dtype, shape, stride, storage_offset, storage_nbytes, flags); flags bit 0 is
# the conjugate bit, bit 1 the negative bit.
Key = tuple


class Handle:
    """The server-side identity of a RemoteTensor; frees it when the last wrapper dies.

    A *lazy view* (`base` set) has no server-side entry at all: it is sent as "this view of
    `base`" wherever it is used, so view ops (`view`, `t`, `transpose`, `detach`, `expand`, ...)
    cost no message. It keeps `base` alive, as a real view keeps its storage alive.
    """

    __slots__ = ("id", "ext", "key", "sess", "base", "dev", "__weakref__")

    def __init__(
        self, sess: Session, tid: int, key: Key, base: Handle | None = None, dev: int = 0
    ) -> None:
        self.id = tid
        self.key = key
        self.sess = sess
        self.base = base
        self.dev = dev  # the rgpu device index (rgpu.devices); a view's is its base's
        if base is None:
            self.ext = _new_ext(_ExtType, (EXT_REF, _pack_id(tid)))  # ref_ext, inlined: hot path
        else:
            self.ext = view_ext(base.id, key[1], key[2], key[3])

    def __del__(self) -> None:
        if self.base is not None:
            return
        try:
            sess = self.sess
            sess.frees.append(self.id)
            sess.free_bytes += self.key[4]
        except Exception:  # interpreter shutdown
            pass


class Traced(Exception):
    """Raised inside dispatch when an argument is a RemoteTensor being traced by torch.compile."""


class _TracedHandle:
    """The `_r` of a RemoteTensor that torch.compile is tracing: it has no server identity."""

    __slots__ = ()
    sess = None
    base = None
    dev = 0

    @property
    def key(self) -> Key:
        raise Traced()

    @property
    def ext(self) -> Any:
        raise Traced()


TRACED = _TracedHandle()


def _not_registered(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("the rgpu device is not registered (import rgpu)")


# Behaviour that lives in other modules, wired in by rgpu._registration (the one place that
# connects them), so this module imports none of them.
_dispatch: Callable = _not_registered  # the body of __torch_dispatch__ (rgpu.dispatch)
_repr: Callable = _not_registered  # repr with one download (rgpu.special_ops)
_on_first_trace: Callable | None = None  # torch.compile traces a RemoteTensor (rgpu.compile)
_reduce: Callable = _not_registered  # pickling, torch.save (rgpu.saving)
_copy: Callable = _not_registered  # copy.copy (rgpu.saving)
_deep_copy: Callable = _not_registered  # copy.deepcopy (rgpu.saving)


def install(dispatch: Callable, repr_: Callable, on_first_trace: Callable, saving: Any) -> None:
    global _dispatch, _repr, _on_first_trace, _reduce, _copy, _deep_copy
    _dispatch, _repr, _on_first_trace = dispatch, repr_, on_first_trace
    _reduce, _copy, _deep_copy = saving.reduce_ex, saving.shallow_copy, saving.deep_copy


class RemoteTensor(torch.Tensor):
    """A tensor on device "rgpu": metadata here, data on the rgpu server.

    For torch.compile it is a traceable wrapper subclass whose one inner tensor is a meta tensor
    (`_rgpu_meta`) that carries the handle: Dynamo and AOTAutograd trace through fake versions of
    it, and the compiled graph later runs on the real metas, whose handles name server tensors.
    """

    _r: Handle

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        try:
            return _dispatch(func, args, kwargs)
        except Exception as e:
            if not backward_errors.in_backward() or backward_errors.nested(_DISPATCH_CODE):
                # IPython keeps the last error: rgpu's frames in it held the op's arguments, their
                # memory and autograd graph (a CPU op's error holds none). The lines stay
                traceback.clear_frames(e.__traceback__)
                args = kwargs = None  # noqa: F841  (this frame is still running)
                raise
            return backward_errors.placeholder(e, func)  # a raise here would abort the process

    def register_hook(self, hook: Callable) -> Any:
        return super().register_hook(backward_errors.guarded(hook))

    def register_post_accumulate_grad_hook(self, hook: Callable) -> Any:
        return super().register_post_accumulate_grad_hook(backward_errors.guarded(hook))

    @property
    def _rgpu_meta(self) -> torch.Tensor:
        m = self.__dict__.get("_m")
        if m is None:
            m = meta_of_key(self._r.key)
            m._rgpu_handle = self._r
            self.__dict__["_m"] = m
        return m

    def __coerce_same_metadata_as_tangent__(
        self, expected_meta: Any, expected_type: type | None = None
    ) -> torch.Tensor:
        """AOTAutograd's backward expected a plain tensor here: the output was made on rgpu from
        no RemoteTensor (`torch.zeros(n, device=x.device)`, then written from one that needs
        grad), so its trace saw a bare tensor. Give what any other RemoteTensor tangent is
        flattened to, its meta with the handle, which the shipped backward graph takes alike."""
        if expected_type is not None and expected_type is not RemoteTensor:
            return self._rgpu_meta
        return self

    def _stable_hash_for_caching(self) -> str:
        """For AOTAutograd's cache: a RemoteTensor's identity for compilation is its layout."""
        return f"rgpu:{self.dtype}:{tuple(self.shape)}:{self.stride()}:{self.storage_offset()}"

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        global _on_first_trace
        if _on_first_trace is not None:  # torch.compile is tracing one of us: Dynamo is loaded
            hook, _on_first_trace = _on_first_trace, None
            hook()
        return ["_rgpu_meta"], None

    @staticmethod
    def __tensor_unflatten__(
        inner: dict, ctx: Any, outer_size: Any, outer_stride: Any
    ) -> RemoteTensor:
        m = inner["_rgpu_meta"]
        if type(m) is RemoteTensor:
            # a compiled graph's output: graphs give RemoteTensors, since AOTAutograd wraps only
            # the outputs that were RemoteTensors while traced and hands the others back as they
            # are (a tensor made on rgpu from no RemoteTensor, `torch.zeros(n, device=x.device)`:
            # a bare meta tensor reached the caller)
            if outer_size is None or (m.shape == outer_size and m.stride() == outer_stride):
                return m
            m = m._rgpu_meta
        return wrap_inner(m, outer_size, outer_stride)

    # -- `.data`: PyTorch's setter copies metadata only, the server tensor must follow -------

    @property
    def data(self) -> torch.Tensor:
        return _DATA.__get__(self)

    @data.setter
    def data(self, new: torch.Tensor) -> None:
        """`p.data = t` (transformers' `resize_token_embeddings`, `vector_to_parameters`): `p`
        becomes `t`'s tensor. PyTorch's setter copies the sizes, strides and dtype onto `p` but
        knows nothing of `_r`, so `p` kept naming its old server tensor: new shape, old values."""
        if type(new) is not RemoteTensor:
            where = new.device if isinstance(new, torch.Tensor) else type(new).__name__
            raise RuntimeError(
                f"cannot assign a tensor on {where} to the .data of a tensor on rgpu: a "
                "tensor's .data cannot move it to another device type here. Move the new data "
                "first (`p.data = t.to(p.device)`), or copy into it (`p.data.copy_(t)`)."
            )
        handle = new._r
        if handle is TRACED or self._r is TRACED:
            raise RuntimeError(
                "cannot assign .data of an rgpu tensor while torch.compile traces it; move "
                "the assignment out of the compiled function"
            )
        _DATA.__set__(self, new)  # sizes, strides, offset, dtype, device: PyTorch's own checks
        self._r = handle  # the same server tensor (or lazy view) as `new`, as on CUDA
        self.__dict__.pop("_m", None)  # the inner meta of torch.compile follows the new layout

    # -- storage identity: what libraries that find shared tensors by pointer read ------------

    def untyped_storage(self) -> torch.UntypedStorage:
        if self._r is TRACED:  # the fake inner's: shared by the fakes of a tensor and its views
            return self._rgpu_meta.untyped_storage()
        if storage_ids.dynamo_is_tracing():
            # Dynamo fakes an input that shares another's storage by set_() onto a meta
            # storage, which PyTorch refuses for a tensor on rgpu; views it relates by `_base`
            return _UNTYPED_STORAGE(self)
        return storage_ids.untyped_storage(self)

    def data_ptr(self) -> int:
        if self._r is TRACED:
            return _DATA_PTR(self)
        return storage_ids.data_ptr(self)

    # -- things torch.Tensor refuses for subclasses, or does with many remote ops ------------

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # one download, not ~15 ops
        if self._r is TRACED:
            return f"RemoteTensor(traced, shape={list(self.shape)}, dtype={self.dtype})"
        return _repr(self)

    def __format__(self, spec: str) -> str:  # as torch.Tensor's, which tests `type(self) is Tensor`
        if self.dim() == 0:
            return format(self.detach().item(), spec)
        return object.__format__(self, spec)

    def tolist(self) -> Any:
        if self._r is TRACED:  # the fake tensor's: a data-dependent error, not endless recursion
            return self._rgpu_meta.tolist()
        return self.detach().cpu().tolist()

    def numpy(self, *, force: bool = False) -> Any:
        if self.requires_grad and not force:
            raise RuntimeError(
                "Can't call numpy() on Tensor that requires grad. Use tensor.detach().numpy() instead."
            )
        return self.detach().cpu().numpy()

    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
        arr = self.detach().cpu().numpy()
        return arr if dtype is None else arr.astype(dtype, copy=False)

    def __deepcopy__(self, memo: dict) -> RemoteTensor:
        return _deep_copy(self, memo)

    def __reduce_ex__(self, proto: int) -> Any:
        return _reduce(self, proto)  # pickled (torch.save) as a CPU tensor: rgpu.saving

    def __copy__(self) -> torch.Tensor:
        return _copy(self)


_make = torch.Tensor._make_wrapper_subclass
_DISPATCH_CODE = RemoteTensor.__torch_dispatch__.__func__.__code__
DEVICE: torch.device | None = None  # torch.device("rgpu", 0), set once the device is registered
DEVICES: list[torch.device] = []  # torch.device("rgpu", i) per device index (rgpu.devices)


def wrap_dense(sess: Session, key: Key, dev: int = 0) -> RemoteTensor:
    """`wrap` for a key `is_dense_key` accepted: PyTorch derives the strides, offset and storage
    size itself, ~1 us less per wrapper (the most common output of all)."""
    w = _make(RemoteTensor, key[1], dtype=key[0], device=DEVICES[dev] if dev else DEVICE)
    w._r = Handle(sess, next_id(), key, None, dev) if dev else Handle(sess, next_id(), key)
    return w


def wrap(sess: Session, key: Key, dev: int = 0) -> RemoteTensor:
    """A new RemoteTensor with metadata `key` and a fresh id in `sess`, on device `dev`."""
    dtype, shape, stride, offset, nbytes, flags = key
    w = _make(
        RemoteTensor,
        shape,
        strides=stride,
        storage_offset=offset,
        dtype=dtype,
        device=DEVICES[dev] if dev else DEVICE,
        storage_size=nbytes,
    )
    if flags:
        if flags & 1:
            torch._C._set_conj(w, True)
        if flags & 2:
            torch._C._set_neg(w, True)
    w._r = Handle(sess, next_id(), key, None, dev) if dev else Handle(sess, next_id(), key)
    return w


def wrap_inner(m: torch.Tensor, size: Any = None, stride: Any = None) -> RemoteTensor:
    """The RemoteTensor around an inner meta: a real one when the meta carries a handle (the
    output of a compiled graph), else a traced one, around a fake tensor, while torch.compile
    traces."""
    handle = getattr(m, "_rgpu_handle", None)
    if (
        handle is None
        and getattr(m, "fake_device", None) is not None
        and m.fake_device.type == "meta"
    ):
        # Traced: make the fake inner claim rgpu, like the tensors the traced code creates with
        # device=x.device, so the two mix; and so composite ops decompose as for rgpu (on meta,
        # ops with Python meta kernels would bypass autograd's decomposition).
        m.fake_device = DEVICE
    w = _make(
        RemoteTensor,
        m.shape if size is None else size,
        strides=m.stride() if stride is None else stride,
        storage_offset=m.storage_offset(),
        dtype=m.dtype,
        device=DEVICES[handle.dev] if handle is not None and handle.dev else DEVICE,
        requires_grad=False,
    )
    w._r = handle if handle is not None else TRACED
    w.__dict__["_m"] = m
    return w


def wrap_view(sess: Session, key: Key, of: Handle) -> RemoteTensor:
    """A lazy view with metadata `key` over the storage of `of` (no server message)."""
    dtype, shape, stride, offset, nbytes, flags = key
    dev = of.dev
    w = _make(
        RemoteTensor,
        shape,
        strides=stride,
        storage_offset=offset,
        dtype=dtype,
        device=DEVICES[dev] if dev else DEVICE,
        storage_size=nbytes,
    )
    w._r = Handle(sess, 0, key, of.base or of, dev)
    return w


def wrap_handle(h: Handle) -> RemoteTensor:
    """A second wrapper over the server tensor of `h` (no new id: `h` frees it once)."""
    dtype, shape, stride, offset, nbytes, flags = h.key
    w = _make(
        RemoteTensor,
        shape,
        strides=stride,
        storage_offset=offset,
        dtype=dtype,
        device=DEVICES[h.dev] if h.dev else DEVICE,
        storage_size=nbytes,
    )
    w._r = h
    return w


def wrap_with_id(sess: Session, key: Key, tid: int, dev: int = 0) -> RemoteTensor:
    w = wrap(sess, key, dev)
    w._r.id = tid
    w._r.ext = ref_ext(tid)
    return w


def patch_metadata(w: RemoteTensor, key: Key) -> None:
    """Change a wrapper's sizes/strides/offset in place, as a metadata-changing in-place op did.

    The wrapper owns a placeholder storage (no data, just a byte count); when the new layout needs
    more bytes, a bigger placeholder is swapped in through the Meta kernel of `set_`.
    """
    relayout(w, key)
    h = w._r
    h.key = key
    if h.base is not None:
        h.ext = view_ext(h.base.id, key[1], key[2], key[3])
    w.__dict__.pop("_m", None)  # its inner meta described the old layout


def relayout(w: RemoteTensor, key: Key) -> None:
    """The wrapper's own sizes/strides/offset (and placeholder storage) become `key`'s."""
    dtype, shape, stride, offset, nbytes, flags = key
    with torch.no_grad(), no_dispatch():
        if nbytes != _UNTYPED_STORAGE(w).nbytes() or dtype != w.dtype:
            big = _make(
                RemoteTensor,
                (nbytes // max(dtype.itemsize, 1),),
                dtype=dtype,
                device=w.device,
                storage_size=nbytes,
            )
            torch._C._set_meta_in_tls_dispatch_include(True)
            try:
                torch.ops.aten.set_.source_Storage_storage_offset(
                    w, _UNTYPED_STORAGE(big), offset, shape, stride
                )
            finally:
                torch._C._set_meta_in_tls_dispatch_include(False)
        else:
            torch.ops.aten.as_strided_.default(w, shape, stride, offset)
