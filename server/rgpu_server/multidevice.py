"""Several devices per server: which ones (--device, --devices, --virtual-devices), the device a
session's messages run on (DEVICE), its generator per device, and its memory per device.

A session runs its messages on one device at a time, as a CUDA program has a current device:
the client sends DEVICE when the device of its next message differs from the last one's, so
the common case (one device) costs nothing. On a CUDA server the worker thread then calls
`torch.cuda.set_device`, and the aten kernels follow their tensors' devices as usual. *Virtual*
devices (`--device cpu --virtual-devices N`) are N rgpu devices that all compute on the CPU:
for them the session's tensor table records the device of every id it stores (`DeviceTable`),
so per-device memory is told apart as on real GPUs; which device a tensor is on, and what may be
mixed with what, the client decides and checks (rgpu/devices.py), as CUDA does.
"""

from __future__ import annotations

from typing import Any

import torch

from rgpu_protocol import DEFAULT_SEED, ProtocolError

from .devices import device_name, pick_device


def pick_devices(
    device: str | None, devices: str | None = None, virtual: int | None = None
) -> list[torch.device]:
    """The server's devices, in rgpu index order, each proven by allocating on it.

    `--devices cuda:0,cuda:2` names them; `--device cuda` (and `auto` on a CUDA host) means
    every visible GPU; `--device cuda:N`, `cpu` or `mps` one device; `--virtual-devices N`
    repeats a CPU device N times.
    """
    if devices:
        if virtual is not None:
            raise SystemExit("rgpu-server: --devices and --virtual-devices do not go together")
        picked = [pick_device(spec.strip()) for spec in devices.split(",") if spec.strip()]
        if len({d.type for d in picked}) > 1:
            raise SystemExit("rgpu-server: --devices must all be of one type (cuda:N or cpu)")
        if len(set(picked)) != len(picked):
            raise SystemExit(f"rgpu-server: --devices names a device twice ({devices})")
        return picked
    if device in (None, "", "auto"):
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if virtual is not None:
        if virtual < 1:
            raise SystemExit("rgpu-server: --virtual-devices must be at least 1")
        if torch.device(device).type != "cpu":
            raise SystemExit("rgpu-server: --virtual-devices needs --device cpu (real GPUs are "
                             "devices of their own: --device cuda exposes them all)")  # fmt: skip
        return [pick_device("cpu")] * virtual
    if device == "cuda" and torch.cuda.is_available():
        return [pick_device(f"cuda:{i}") for i in range(torch.cuda.device_count())]
    return [pick_device(device)]


def describe(devices: list[torch.device] | tuple[torch.device, ...]) -> tuple[tuple[str, str], ...]:
    """WELCOME's devices: (torch device, name) per rgpu index."""
    virtual = _virtual(tuple(devices))
    return tuple(
        (str(d), device_name(d) + (f", virtual device {i} of {len(devices)}" if virtual else ""))
        for i, d in enumerate(devices)
    )


class DeviceTable(dict):
    """A session's id -> tensor table that also remembers the device index each id was stored
    on (the session's current device then): virtual devices cannot be told apart otherwise."""

    __slots__ = ("index", "where")

    def __init__(self) -> None:
        super().__init__()
        self.index = 0
        self.where: dict[int, int] = {}

    def __setitem__(self, key: int, value: Any) -> None:
        dict.__setitem__(self, key, value)
        self.where[key] = self.index

    def __delitem__(self, key: int) -> None:
        dict.__delitem__(self, key)
        self.where.pop(key, None)

    def pop(self, key: int, *default: Any) -> Any:
        self.where.pop(key, None)
        return dict.pop(self, key, *default)

    def clear(self) -> None:
        dict.clear(self)
        self.where.clear()

    def put(self, key: int, value: Any, index: int) -> None:
        """Store `value` as on device `index`, whatever the current device is."""
        dict.__setitem__(self, key, value)
        self.where[key] = index


def setup(s: Any, devices: tuple[torch.device, ...]) -> None:
    """Give a new session the server's devices: a generator each, and a `DeviceTable` when
    they are virtual."""
    s.devices = tuple(devices)
    s.generators = [s.generator]
    for d in s.devices[1:]:
        g = torch.Generator(device=d)
        g.manual_seed(DEFAULT_SEED)
        s.generators.append(g)
    if _virtual(s.devices):
        s.tensors = DeviceTable()


def _virtual(devices: tuple[torch.device, ...]) -> bool:
    return len(devices) > 1 and len(set(devices)) == 1


def set_device(s: Any, index: int) -> None:
    """Later messages of `s` run on device `index`."""
    if type(index) is not int or not 0 <= index < len(s.devices):
        raise ProtocolError(f"no device {index}: this server has {len(s.devices)}")
    s.device_index = index
    s.device = s.devices[index]
    s.generator = s.generators[index]
    if type(s.tensors) is DeviceTable:
        s.tensors.index = index
    if s.device.type == "cuda":
        torch.cuda.set_device(s.device)  # per thread: this session's worker only


def device(s: Any, seq: int, msg: list) -> None:
    """DEVICE [index]."""
    set_device(s, msg[1])


def reset(s: Any) -> None:
    """A fresh stream (a named session re-opened by a new client) starts on device 0."""
    if _virtual(s.devices):
        s.tensors = DeviceTable()
    set_device(s, 0)


def seed(s: Any, value: int, index: int | None) -> None:
    """SEED: one device's generator, or (no index) every device's."""
    value &= 0xFFFF_FFFF_FFFF_FFFF
    if index is None:
        for g in s.generators:
            g.manual_seed(value)
    elif 0 <= index < len(s.generators):
        s.generators[index].manual_seed(value)
    else:
        raise ProtocolError(f"SEED names device {index}: this server has {len(s.generators)}")


def index_of(s: Any, name: str) -> torch.device:
    """The torch device for a device the client named: "rgpu" is the current device."""
    if name == "rgpu":
        return s.device
    try:
        index = int(name[5:])
    except ValueError:
        raise ProtocolError(f"bad device name {name!r}") from None
    if not 0 <= index < len(s.devices):
        raise ProtocolError(f"no device {name}: this server has {len(s.devices)}")
    return s.devices[index]


def index_of_tensor(s: Any, t: torch.Tensor, tid: int) -> int:
    """The index of the device the session's tensor `tid` is on (KEEP remembers it)."""
    table = s.tensors
    if type(table) is DeviceTable:
        return table.where.get(tid, 0)
    for i, d in enumerate(s.devices):
        if t.device == d:
            return i
    return 0


def store(s: Any, tid: int, t: torch.Tensor, index: int) -> None:
    """Store a tensor (a kept one given back by KEPT) as on device `index`, not the current."""
    table = s.tensors
    if type(table) is DeviceTable:
        table.put(tid, t, index)
    else:
        table[tid] = t


def memory_by_device(s: Any) -> list[int]:
    """Bytes of distinct storages this session holds on each device."""
    table = s.tensors
    where = table.where if type(table) is DeviceTable else None
    rgpu_index = {d: i for i, d in enumerate(s.devices)}
    seen: list[dict[int, int]] = [{} for _ in s.devices]
    for tid, t in list(table.items()):
        if not isinstance(t, torch.Tensor):
            continue
        i = where.get(tid, 0) if where is not None else rgpu_index.get(t.device, 0)
        st = t.untyped_storage()
        seen[i][st.data_ptr() or id(st)] = st.nbytes()
    return [sum(d.values()) for d in seen]
