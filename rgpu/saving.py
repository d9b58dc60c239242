"""Pickling and copying rgpu tensors (`torch.save`, `pickle`, `copy.copy`, `copy.deepcopy`).

An rgpu tensor is pickled as a plain CPU tensor (a parameter as a parameter): the file loads
anywhere, with `weights_only=True` and without rgpu; `load_state_dict` moves it back onto rgpu
parameters and `torch.load(map_location="rgpu")` uploads it.

PyTorch pickles a tensor with its whole storage, so tensors that share one (a view and its base,
two halves of a fused weight) share it in the file and again after loading. Within one
`torch.save` each server storage is downloaded once and each tensor on it becomes a view of that
CPU copy, with its own offset and strides. Before, each tensor was downloaded on its own: a view
and its base came back as two unrelated tensors (a write to one no longer showed in the other),
and the file held their bytes twice. The tensors `torch.save` is given in a state dict, an
optimizer's, a list or a module are downloaded together first, with one wait.

`copy.copy(t)` is, as for a CPU or CUDA tensor, a new tensor over the same storage (it went
through pickling and came back on the CPU). `copy.deepcopy` copies each storage once, so copied
views stay views of the copied base, and a parameter as `nn.Parameter` does (its data, not its
gradient). Its attributes are copied, but never the copied tensor's own: the copy of a tensor
torch.compile had traced kept that tensor's cached handle, and compiled code ran on the original.
"""

from __future__ import annotations

import contextvars
import copy
import functools
from typing import Any

import torch
import torch.utils._pytree as pytree

from . import current as _cur
from . import devices as _devices
from .tensor import RemoteTensor

_downloaded: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "rgpu_saving", default=None
)  # within one torch.save: server storage address -> its bytes on the CPU
_original_save = torch.serialization.save


def _host_storage(t: torch.Tensor) -> torch.UntypedStorage:
    """The bytes of `t`'s whole server storage, downloaded once per `torch.save`."""
    storage = t.untyped_storage()
    memo = _downloaded.get()
    key = storage.data_ptr()
    host = memo.get(key) if memo is not None else None
    if host is None:
        whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
        host = whole.cpu().untyped_storage()
        if memo is not None:
            memo[key] = host
    return host


def reduce_ex(t: torch.Tensor, proto: int) -> Any:
    host = torch.empty(0, dtype=t.dtype)
    host.set_(_host_storage(t), t.storage_offset(), t.shape, t.stride())
    if getattr(t, "_is_param", False):
        return torch.nn.Parameter(host, requires_grad=t.requires_grad).__reduce_ex__(proto)
    if t.requires_grad:
        host.requires_grad_(True)
    return host.__reduce_ex__(proto)


def shallow_copy(t: torch.Tensor) -> torch.Tensor:
    alias = t.detach().requires_grad_(t.requires_grad)
    if getattr(t, "_is_param", False):
        return torch.nn.Parameter(alias, requires_grad=t.requires_grad)
    return alias


def _remote_tensors(obj: Any) -> list[RemoteTensor]:
    found = []
    for leaf in pytree.tree_leaves(obj):
        if isinstance(leaf, torch.nn.Module):
            found.extend(
                t for t in (*leaf.parameters(), *leaf.buffers()) if type(t) is RemoteTensor
            )
        elif type(leaf) is RemoteTensor:
            found.append(leaf)
    return found


def _prefetch(obj: Any, memo: dict) -> None:
    """The storages of the rgpu tensors in `obj` (a state dict, an optimizer's, a module),
    downloaded together: one wait for a checkpoint, not one per tensor."""
    pending = []
    for t in _remote_tensors(obj):
        storage = t.untyped_storage()
        if storage.data_ptr() in memo:
            continue
        whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
        host = torch.empty(whole.numel(), dtype=torch.uint8)
        sess = t._r.sess if _devices.MULTI and t._r.sess is not None else _cur.current()
        pending.append((sess, sess.download_later(whole, into=host)[1]))
        memo[storage.data_ptr()] = host.untyped_storage()
    for sess, waiter in reversed(pending):  # replies come in order: the last one's wait is all
        sess.wait_for(waiter)


_NOT_COPIED = ("_r", "_m", "_is_param")  # the server tensor, its traced meta, made anew
_NOT_A_LEAF = (
    "Only Tensors created explicitly by the user (graph leaves) support the deepcopy protocol at "
    "the moment.  If you were attempting to deepcopy a module, this may be because of a "
    "torch.nn.utils.weight_norm usage, see https://github.com/pytorch/pytorch/pull/103001"
)


def deep_copy(t: torch.Tensor, memo: dict) -> torch.Tensor:
    if id(t) in memo:
        return memo[id(t)]
    with torch.no_grad():
        if getattr(t, "_is_param", False):  # as nn.Parameter's own: no gradient
            new = torch.nn.Parameter(
                t.clone(memory_format=torch.preserve_format), requires_grad=t.requires_grad
            )
        else:
            if not t.is_leaf:
                raise RuntimeError(_NOT_A_LEAF)
            storage = t.untyped_storage()
            key = ("rgpu storage", storage.data_ptr())  # beside deepcopy's own id() keys
            copied = memo.get(key)
            if copied is None:
                copied = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage).clone()
                memo[key] = copied
            new = torch.empty(0, dtype=t.dtype, device=t.device)
            new.set_(copied.untyped_storage(), t.storage_offset(), t.shape, t.stride())
            new.requires_grad_(t.requires_grad)
            if t.grad is not None:
                new.grad = deep_copy(t.grad, memo)
    memo[id(t)] = new
    for name, value in t.__dict__.items():
        if name not in _NOT_COPIED:
            new.__dict__[name] = copy.deepcopy(value, memo)
    return new


@functools.wraps(_original_save)
def save(obj: Any, *args: Any, **kwargs: Any) -> Any:
    memo: dict = {}
    token = _downloaded.set(memo)
    try:
        _prefetch(obj, memo)
        return _original_save(obj, *args, **kwargs)
    finally:
        _downloaded.reset(token)


def install() -> None:
    """`torch.save` (and `torch.serialization.save`) keep one download per storage."""
    if torch.serialization.save is _original_save:
        torch.serialization.save = save
        torch.save = save
