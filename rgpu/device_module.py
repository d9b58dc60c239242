"""`torch.rgpu`: the device module PyTorch looks up for the "rgpu" device type."""

from __future__ import annotations

import types

import torch

from rgpu_protocol import Kind

from . import current as _cur


def is_available() -> bool:
    """rgpu is always available: a server is started locally if none is configured."""
    return True


def is_initialized() -> bool:
    return True


def _is_in_bad_fork() -> bool:
    return False


def device_count() -> int:
    return 1


def current_device() -> int:
    return 0


def set_device(device: object) -> None:
    idx = torch.device(device).index if not isinstance(device, int) else device
    if idx not in (None, 0):
        raise ValueError(f"rgpu has one device, rgpu:0; cannot select {device!r}")


class device:
    """Context manager selecting an rgpu device; there is only rgpu:0, so it checks and does nothing."""

    def __init__(self, device: object) -> None:
        if device is not None and not (isinstance(device, int) and device in (-1, 0)):
            set_device(device)

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def synchronize(device: object = None) -> None:
    """Wait until the server has run everything sent so far (one wait)."""
    _cur.current().synchronize()


def manual_seed(seed: int) -> None:
    """Seed this session's generator on the server (no wait)."""
    _cur.seed(int(seed))


def manual_seed_all(seed: int) -> None:
    _cur.seed(int(seed))


def get_device_name(device: object = None) -> str:
    """The server's device, e.g. "NVIDIA H200" or "CPU (x86_64, 16 cores)"."""
    return _cur.current().device_name


def memory_allocated(device: object = None) -> int:
    """Bytes of tensor storage this session holds on the server (one wait)."""
    return int(_cur.current().info()["bytes"])


def get_rng_state(device: object = None) -> torch.Tensor:
    """This session's generator state on the server, as a CPU uint8 tensor (one wait)."""
    state = _cur.current().request((Kind.RNG_GET,))
    return torch.frombuffer(bytearray(state), dtype=torch.uint8)


def set_rng_state(new_state: torch.Tensor, device: object = None) -> None:
    """Restore a state from `get_rng_state` (no wait)."""
    data = new_state.detach().cpu().contiguous().to(torch.uint8)
    _cur.current().post((Kind.RNG_SET, bytes(data.numpy().tobytes())))


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state()]


def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
    set_rng_state(new_states[0])


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
        session = _cur.current()
        self._session = session
        self._waiter = session.record_event()

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


module = types.ModuleType("torch.rgpu")
module._initialized = True  # torch.utils.checkpoint only saves device RNG states when this is set
for _name in (
    "is_available", "is_initialized", "_is_in_bad_fork", "device_count", "current_device",
    "set_device", "synchronize", "manual_seed", "manual_seed_all", "get_device_name",
    "memory_allocated", "get_amp_supported_dtype", "get_rng_state", "set_rng_state",
    "get_rng_state_all", "set_rng_state_all", "initial_seed", "seed", "seed_all", "device",
    "Event",
):  # fmt: skip
    setattr(module, _name, globals()[_name])
