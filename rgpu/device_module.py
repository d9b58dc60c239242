"""`torch.rgpu`: the device module PyTorch looks up for the "rgpu" device type.

It mirrors `torch.cuda`: several devices (rgpu:0..N-1 over the connected servers, rgpu.devices),
a current device per thread, and per-device synchronize, events, generators and memory.
"""

from __future__ import annotations

import types
from collections import OrderedDict

import torch

from rgpu_protocol import Kind

from . import current as _cur
from . import devices as _devices
from .errors import RgpuError
from .generator_refs import state_bytes, state_tensor


def is_available() -> bool:
    """rgpu is always available: a server is started locally if none is configured."""
    return True


def is_initialized() -> bool:
    return True


def _is_in_bad_fork() -> bool:
    return False


def device_count() -> int:
    """The devices of the connected servers (connecting first, as any use of rgpu does)."""
    _cur.current()
    return _devices.count()


def current_device() -> int:
    """This thread's current device index (0 until `set_device`)."""
    return _devices.current()


def _index(device: object) -> int:
    """A device index, checked against the servers' devices (connecting first)."""
    if device is None or (isinstance(device, int) and device == 0):
        return _devices.current() if device is None else 0
    _cur.current()
    return _devices.index_of(device)


def set_device(device: object) -> None:
    """Make `device` (an index, "rgpu:i" or a torch.device) this thread's current device:
    `device="rgpu"` means it from now on. A negative index does nothing, as with CUDA."""
    if isinstance(device, int) and device < 0:
        return
    _devices.set_current(_index(device))


class device:
    """Context manager: `device` is the current device inside the block (None or -1: no change)."""

    def __init__(self, device: object) -> None:
        self.idx = -1 if device is None or device == -1 else _index(device)
        self.prev = -1

    def __enter__(self) -> None:
        self.prev = _devices.current()
        if self.idx >= 0:
            _devices.set_current(self.idx)

    def __exit__(self, *exc: object) -> None:
        _devices.set_current(self.prev)


def _on(device: object) -> tuple:
    """(session, index on its server) of a device (None: the current one)."""
    sess = _cur.current()
    return _devices.session_of(_index(device), sess)


def synchronize(device: object = None) -> None:
    """Wait until the device's server has run everything sent so far (one wait)."""
    sess, local = _on(device)
    sess.synchronize(device=local if _devices.MULTI else None)


def manual_seed(seed: int) -> None:
    """Seed the current device's generator on its server (no wait)."""
    if _devices.count() <= 1:
        _cur.seed(int(seed))
        return
    sess, local = _on(None)
    sess.post((Kind.SEED, int(seed), local))


def manual_seed_all(seed: int) -> None:
    """Seed every device's generator (no wait); remembered for later sessions."""
    _cur.seed(int(seed))


def get_device_name(device: object = None) -> str:
    """The device's name, e.g. "NVIDIA H200" or "CPU (x86_64, 16 cores, 15 threads a kernel)"."""
    sess, local = _on(device)
    return sess.devices[local][1]


def memory_allocated(device: object = None) -> int:
    """Bytes of tensor storage this session holds on the device (one wait)."""
    sess, local = _on(device)
    info = sess.info()
    per_device = info.get("device_bytes")
    return int(per_device[local] if per_device else info["bytes"])


def mem_get_info(device: object = None) -> tuple[int, int]:
    """(free, total) bytes of the device, read on its server now (one wait): a GPU's memory, or
    a CPU server's RAM. As with CUDA, what every process on the device uses counts."""
    sess, local = _on(device)
    info = sess.request((Kind.INFO,), device=local if _devices.MULTI else None)
    used, total = info.get("memory_used"), info.get("memory_total")
    if used is None or total is None:
        raise RgpuError(f"the server cannot tell the memory of {info.get('device', 'its device')}")
    return int(total) - int(used), int(total)


def release_now() -> None:
    """Send the frees of tensors Python has dropped now, not with the next batch (no wait).
    Not connected: nothing to release, and no server is started for it."""
    for sess in _cur.sessions():
        sess.flush()


empty_cache = release_now  # as torch.cuda.empty_cache: give back what nothing uses any more
memory_reserved = memory_allocated  # the server's allocator cache is shared by all its sessions


def memory_stats(device: object = None) -> OrderedDict[str, int]:
    """The counters rgpu has, under CUDA's names: what this session holds now (one wait)."""
    held = memory_allocated(device)
    return OrderedDict(
        [("allocated_bytes.all.current", held), ("reserved_bytes.all.current", held)]
    )


def no_peaks(*_: object, **__: object) -> int:
    """CUDA's peak counters: code ported from CUDA calls them, and gets a reason, not a number
    that would mix every session of a shared server process."""
    raise RgpuError(
        "rgpu does not track peak memory: max_memory_allocated, max_memory_reserved and "
        "reset_peak_memory_stats are not available on rgpu (torch.rgpu or torch.accelerator); "
        "torch.rgpu.memory_allocated(i) gives the bytes this session holds now"
    )


max_memory_allocated = max_memory_reserved = no_peaks
reset_peak_memory_stats = reset_max_memory_allocated = reset_accumulated_memory_stats = no_peaks


def get_rng_state(device: object = None) -> torch.Tensor:
    """The device's generator state on its server, as a CPU uint8 tensor (one wait)."""
    sess, local = _on(device)
    return state_tensor(sess.request((Kind.RNG_GET,), device=local if _devices.MULTI else None))


def set_rng_state(new_state: torch.Tensor, device: object = None) -> None:
    """Restore a state from `get_rng_state` (no wait)."""
    data = state_bytes(new_state, "get_rng_state")
    sess, local = _on(device)
    sess.post((Kind.RNG_SET, data), device=local if _devices.MULTI else None)


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state(i) for i in range(device_count())]


def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
    for i, state in enumerate(new_states):
        set_rng_state(state, i)


def initial_seed() -> int:
    return _cur.initial_seed()


def seed() -> None:
    """Seed this session's generator with a random number."""
    import random

    _cur.seed(random.getrandbits(63))


def seed_all() -> None:
    seed()


class Event:
    """A marker in the op stream, like `torch.cuda.Event`: `record()` costs no wait.

    `query()` says whether the server has run everything sent before the record;
    `synchronize()` waits for that (one wait, none if it is already known). With
    `enable_timing=True`, `elapsed_time(end)` gives milliseconds between two records measured
    on the server's clock, once both are done. A record makes the server let its device go
    idle at that point, so record around work you time, not inside a hot loop.
    """

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> None:
        if interprocess:
            raise ValueError("rgpu events cannot be shared between processes")
        self.enable_timing = enable_timing
        self.blocking = blocking
        self._waiter = None
        self._session = None

    def record(self, stream: object = None) -> None:
        """Mark the current device's stream (`stream`'s device, when one is given)."""
        session, local = _on(getattr(stream, "device", None))
        self._session = session
        self._waiter = session.record_event(device=local if _devices.MULTI else None)

    def query(self) -> bool:
        """True when everything before the record has run (an unrecorded event is done)."""
        if self._waiter is None:
            return True
        if not self._waiter.event.is_set():
            return False
        self.synchronize()  # no wait: raises if the work before it failed
        return True

    def synchronize(self) -> None:
        if self._waiter is not None:
            self._session.wait_for(self._waiter)
            self._session.check_async_error()

    def wait(self, stream: object = None) -> None:
        """Make later work wait for this event: the op stream is already in order, so nothing to do."""

    def elapsed_time(self, end_event: Event) -> float:
        """Milliseconds between this record and `end_event`'s, on the server's clock."""
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("both events must be created with enable_timing=True")
        for e in (self, end_event):
            if e._waiter is None:
                raise RuntimeError("both events must be recorded before calling elapsed_time()")
            if not e._waiter.event.is_set():
                raise RuntimeError(
                    "an event has not completed yet; call synchronize() on it before elapsed_time()"
                )
        start = self._session.wait_for(self._waiter)
        end = end_event._session.wait_for(end_event._waiter)
        return (float(end) - float(start)) * 1000.0


def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.float16, torch.bfloat16]


def is_bf16_supported(including_emulation: bool = True) -> bool:
    """Whether bfloat16 runs on the current device: a CPU server's always does, and a GPU's
    does at least emulated (CUDA's answer with `including_emulation`); natively, only the GPU's
    compute capability tells, which the server does not send."""
    if including_emulation:
        return True  # asked before connecting too (TrainingArguments(bf16=True))
    sess, local = _on(None)
    if str(sess.devices[local][0]).startswith("cpu"):
        return True
    raise NotImplementedError(
        "rgpu cannot tell whether the server's GPU runs bfloat16 natively (its compute "
        "capability is not sent); is_bf16_supported() with including_emulation=True says True"
    )


module = types.ModuleType("torch.rgpu")
module._initialized = True  # torch.utils.checkpoint only saves device RNG states when this is set
for _name in (
    "is_available", "is_initialized", "_is_in_bad_fork", "device_count", "current_device",
    "set_device", "synchronize", "manual_seed", "manual_seed_all", "get_device_name",
    "memory_allocated", "get_amp_supported_dtype", "is_bf16_supported", "get_rng_state",
    "set_rng_state", "get_rng_state_all", "set_rng_state_all", "initial_seed", "seed", "seed_all",
    "device",
    "Event", "mem_get_info", "empty_cache", "memory_reserved", "memory_stats",
    "max_memory_allocated", "max_memory_reserved", "reset_peak_memory_stats",
    "reset_max_memory_allocated", "reset_accumulated_memory_stats",
):  # fmt: skip
    setattr(module, _name, globals()[_name])
