"""Storages that say which server storage an rgpu tensor lives in, as a CUDA tensor's storage does.

Libraries find shared and tied tensors by storage pointer: `safetensors.torch.save_file`,
transformers' `save_pretrained` (which drops a tied copy and refuses undeclared sharing), and
pickling by storage. A wrapper subclass's own storage holds no memory and raises on `data_ptr()`
("invalid python storage"), and each wrapper has its own, so views of one tensor looked unrelated.

`RemoteTensor.untyped_storage()` answers instead with one storage per server storage (a tensor
and all its lazy views share it) whose `data_ptr()` is an address in a range no host memory uses:
unique, stable while the tensor lives, never dereferenced (any read of it goes through rgpu's
dispatch, which refuses raw storages with a clear message). `data_ptr()` of a tensor is that
address plus its offset, so `a.data_ptr() == b.data_ptr()` means what it means on CUDA.

Unlike a CUDA storage, the storage object does not keep the server memory alive (it is cached per
server storage for as long as that lives, and a reference back would keep both forever): hold a
tensor. `t.set_(storage, ...)` over such a storage makes `t` view the server storage.
"""

from __future__ import annotations

import sys
import threading
import weakref
from typing import Any

import torch

# Above any user-space address on x86-64 and arm64 (< 2**48), below 2**63: fits an int64.
_FIRST_ADDRESS = 1 << 52
_ALIGN = 1 << 12
_next = [_FIRST_ADDRESS]
_lock = threading.Lock()
# per server storage (the base Handle): (address, the storage object) — same object every call,
# so `StorageWeakRef(t.untyped_storage())` agrees for a tensor and its views
_storages: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _reserve(nbytes: int) -> int:
    with _lock:
        address = _next[0]
        _next[0] += (nbytes + 2 * _ALIGN - 1) // _ALIGN * _ALIGN  # a gap: no two ranges touch
    return address


# a server tensor that is a view of another's storage (made on the server, not lazily) -> the
# handle that owns the storage
_alias_of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def alias(handle: Any, of: Any) -> None:
    """Record that the server tensor `handle` views the storage of `of` (a handle)."""
    owner = of.base or of
    _alias_of[handle] = _alias_of.get(owner, owner)


def _entry(t: Any) -> tuple[int, torch.UntypedStorage]:
    handle = t._r
    base = handle.base or handle
    base = _alias_of.get(base, base)
    entry = _storages.get(base)
    nbytes = base.key[4]
    if entry is None or entry[1].nbytes() != nbytes:  # new, or resized in place (a new block)
        address = _reserve(nbytes)
        storage = torch._C._construct_storage_from_data_pointer(address, t.device, nbytes)
        entry = (address, storage)
        _storages[base] = entry
        _owners[address] = weakref.ref(base, lambda _, a=address: _owners.pop(a, None))
    return entry


# address -> the handle owning that storage: set_(storage) and torch.load find the server
# storage a storage object stands for (addresses are never reused)
_owners: dict[int, weakref.ref] = {}


def owner(storage: torch.UntypedStorage) -> Any:
    """The handle whose server storage `storage` stands for, or None (not one of ours)."""
    if storage.device.type != "rgpu":
        return None
    try:
        ref = _owners.get(storage.data_ptr())
    except RuntimeError:  # a wrapper's own storage: it holds no memory and names no tensor
        return None
    return None if ref is None else ref()


def standing_for(t: Any, keep: Any = None) -> torch.UntypedStorage:
    """A new storage object at `t`'s storage address; it keeps `keep` alive while it lives
    (torch.load: the uploaded bytes, until its tensors are rebuilt over them)."""
    address, cached = _entry(t)
    storage = torch._C._construct_storage_from_data_pointer(address, t.device, cached.nbytes())
    if keep is not None:
        weakref.finalize(storage, _held.pop, id(storage))
        _held[id(storage)] = keep
    return storage


_held: dict[int, Any] = {}


def untyped_storage(t: Any) -> torch.UntypedStorage:
    """The storage standing for the server storage of `t` (not a traced tensor)."""
    return _entry(t)[1]


def data_ptr(t: Any) -> int:
    """`t`'s address in its storage's range, as CUDA's data_ptr() is."""
    return _entry(t)[0] + t.storage_offset() * t.element_size()


def dynamo_is_tracing() -> bool:
    guards = sys.modules.get("torch._guards")
    return guards is not None and guards.TracingContext.try_get() is not None
