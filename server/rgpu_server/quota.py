"""A session's memory quota: the bytes of the distinct storages its tensors hold.

Factories are sized on the meta device and refused before they allocate; other ops' outputs are
counted after they ran and dropped, like an out-of-memory error, when they go over.
"""

from __future__ import annotations

from typing import Any

import torch


class Quota:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._storage_of: dict[int, int] = {}  # tensor id -> storage key
        self._storages: dict[int, list[int]] = {}  # storage key -> [nbytes, refcount]

    def charge(self, tensors: dict, ids: Any) -> bool:
        """Count the storages of these new ids; False when the session is now over its limit
        (the caller drops them)."""
        for i in ids:
            if i is None:
                continue
            t = tensors.get(i)
            if not isinstance(t, torch.Tensor) or i in self._storage_of:
                continue
            st = t.untyped_storage()
            key = st.data_ptr() or -id(st)
            entry = self._storages.get(key)
            if entry is None:
                self._storages[key] = [st.nbytes(), 1]
                self.held += st.nbytes()
            else:
                entry[1] += 1
            self._storage_of[i] = key
        return self.held <= self.limit

    def uncharge(self, tid: int) -> None:
        key = self._storage_of.pop(tid, None)
        if key is None:
            return
        entry = self._storages[key]
        entry[1] -= 1
        if entry[1] == 0:
            del self._storages[key]
            self.held -= entry[0]

    def fits(self, nbytes: int) -> bool:
        return self.held + nbytes <= self.limit

    def message(self, need: int = 0) -> str:
        return (
            f"OutOfMemoryError: this session holds {self.held} bytes"
            + (f" and asked for {need} more" if need else "")
            + f"; its quota on this server is {self.limit} bytes. Free tensors you no longer need "
            "(del them) and try again."
        )


def factory_bytes(resolved: Any, args: list, kwargs: dict | None) -> int:
    """Bytes a factory would allocate, from its meta kernel: refused before it allocates."""
    meta_kwargs = dict(kwargs or {})
    meta_kwargs["device"] = torch.device("meta")
    try:
        out = resolved.op(*args, **meta_kwargs)
    except Exception:
        return 0  # the real call will fail with the real error
    outs = out if isinstance(out, (list, tuple)) else [out]
    return sum(t.numel() * t.element_size() for t in outs if isinstance(t, torch.Tensor))
