"""`torch.Generator(device="rgpu")`: a generator whose state lives on the server.

Why: notebooks pass their own generator to random ops (`torch.randn(..., generator=g)`, the
`generator=` of `nn.init`, diffusers' `torch.Generator(device).manual_seed(0)`), and PyTorch
makes a PrivateUse1 generator only through a C++ hook a Python backend cannot register. So
`torch.Generator` becomes a subclass of the C type whose constructor makes, for an rgpu device,
a generator that stands for one on the server: seeding it, reading and setting its state go to
the server, and an op given it draws from it there, in order with the ops around it. Any other
device gets torch's own generator, and `isinstance` answers as before for every generator.

The server makes its generator the first time a message names it, from the device and the seed
the reference carries (`rgpu_protocol.generators`), so nothing waits to create one. The CPU
generator underneath is seeded alongside: `initial_seed()` is torch's own, and a CPU op given
this generator by mistake draws from a CPU generator with the same seed.
"""

from __future__ import annotations

import itertools
import secrets
import weakref
from typing import Any

import torch

from rgpu_protocol import Kind

from . import current as _cur
from . import devices as _devices
from .generator_refs import LIVE, state_bytes, state_tensor
from .import_hooks import after_import
from .tensor import DEVICE_TYPE

_Base = torch._C.Generator
# ids unique across processes: a restarted kernel attaching to a named session must not meet
# the generators an earlier client left there under the same numbers
_ids = itertools.count(secrets.randbits(48) << 8)
_dropped: list[tuple[int, int]] = []  # (device index, id) of generators garbage-collected


class _GeneratorType(type(_Base)):
    """Every `torch._C.Generator` is an instance of the patched `torch.Generator`, as before."""

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, _Base) if cls is Generator else type.__instancecheck__(cls, obj)

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, _Base) if cls is Generator else type.__subclasscheck__(cls, sub)


class Generator(_Base, metaclass=_GeneratorType):
    __doc__ = _Base.__doc__  # torch.Generator's own (`help`, `?` in a notebook)

    def __new__(cls, device: Any = None) -> Any:
        d = torch.device(device) if device is not None else None
        if d is not None and d.type == DEVICE_TYPE:
            if cls is not Generator:
                raise NotImplementedError(
                    f"{cls.__name__} subclasses torch.Generator; rgpu makes plain rgpu generators "
                    "only: torch.Generator(device='rgpu')"
                )
            return RemoteGenerator._make(_devices.index_of(d))
        if cls is not Generator:  # a program's own subclass, on another device
            return _Base.__new__(cls, *(() if device is None else (device,)))
        return _Base(device) if device is not None else _Base()


class RemoteGenerator(Generator):
    """A generator on an rgpu device: its state lives on the server."""

    @classmethod
    def _make(cls, index: int) -> RemoteGenerator:
        g = _Base.__new__(cls)
        g._rgpu_index = index
        g._rgpu_id = next(_ids)
        key = g._cdata
        LIVE[key] = weakref.ref(g)
        weakref.finalize(g, _drop, key, g._rgpu_id, g._rgpu_index)
        return g

    @property
    def device(self) -> torch.device:
        return torch.device(DEVICE_TYPE, self._rgpu_index)

    def manual_seed(self, seed: Any) -> RemoteGenerator:
        _Base.manual_seed(self, seed)  # torch's checks and its wrap of negative seeds
        self._tell(_Base.initial_seed(self))
        return self

    def seed(self) -> int:
        value = _Base.seed(self)
        self._tell(value)
        return value

    def get_state(self) -> torch.Tensor:
        """The server generator's state as a CPU uint8 tensor (one wait)."""
        session, _ = self._session()
        return state_tensor(session.request((Kind.GENERATOR_STATE, self)))

    def set_state(self, new_state: torch.Tensor) -> RemoteGenerator:
        self._tell(state_bytes(new_state, "get_state"))
        return self

    def __reduce__(self) -> tuple:  # pickle and copy.deepcopy: the same device and state
        return _rebuild, (str(self.device), _Base.initial_seed(self), self.get_state())

    def _unsupported(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            "rgpu generators support manual_seed, seed, initial_seed, get_state and set_state; "
            "offsets, clone_state and graph-safe states are CUDA-graph features rgpu does not have"
        )

    clone_state = graphsafe_get_state = graphsafe_set_state = _unsupported
    get_offset = set_offset = _unsupported

    # -- the server side ---------------------------------------------------------------------

    def _session(self) -> tuple[Any, int]:
        """(session, device index on its server) of this generator's device."""
        return _devices.session_of(self._rgpu_index, _cur.current())

    def _tell(self, value: Any) -> None:
        """Seed (int) or set the state (bytes) of the server's generator, after the ops sent
        before; lazily, while no session is open (the reference then carries the seed)."""
        if _cur._current is None:
            if isinstance(value, bytes):
                _cur.current()  # raises: not connected
            return
        session, _ = self._session()
        _send_dropped()
        session.post((Kind.GENERATOR, self, value))


def _rebuild(device: str, seed: int, state: torch.Tensor) -> RemoteGenerator:
    g = Generator(device)
    _Base.manual_seed(g, seed)
    return g.set_state(state)


def _drop(key: int, gen_id: int, index: int) -> None:
    """A generator was garbage-collected: its server drops its own with the next generator
    message (posting here could meet the session's lock, held by this very thread)."""
    ref = LIVE.get(key)
    if ref is not None and ref() is None:  # not a newer generator at the same address
        del LIVE[key]
    _dropped.append((index, gen_id))


def _send_dropped() -> None:
    while _dropped:
        index, gen_id = _dropped.pop()
        session = _cur._current
        if session is not None and index < _devices.count():
            session, _ = _devices.session_of(index, session)
            if not session.closed and session.broken is None:
                session.post((Kind.GENERATOR, gen_id, None))  # by id: nothing to make


def install() -> None:
    torch.Generator = Generator  # type: ignore[misc]
    # the two places PyTorch tells generators by identity, not isinstance: TorchScript's
    # annotations (`torch._C.Generator` is still the generator type) and Dynamo, which takes a
    # generator of exactly the C type as an object whose ops it runs eagerly (a graph break),
    # and any other kind as an opaque script object that its fake tensors cannot draw from
    annotations = torch.jit.annotations
    to_type = annotations.try_ann_to_type

    def try_ann_to_type(ann: Any, loc: Any, rcb: Any = None) -> Any:
        return to_type(Generator if ann is _Base else ann, loc, rcb)

    annotations.try_ann_to_type = try_ann_to_type
    after_import("torch._dynamo.variables.script_object", _dynamo_sees_a_generator)


def _dynamo_sees_a_generator(module: Any) -> None:
    """Dynamo's test for an opaque object answers no for an rgpu generator (its class is named
    CustomClassObjectVariable or TorchScriptObjectVariable, by release)."""
    for name in ("CustomClassObjectVariable", "TorchScriptObjectVariable"):
        cls = getattr(module, name, None)
        if cls is not None and hasattr(cls, "is_matching_cls"):
            matching = cls.is_matching_cls.__func__

            def is_matching_cls(c: Any, user_cls: type, matching: Any = matching) -> bool:
                return user_cls is not RemoteGenerator and matching(c, user_cls)

            cls.is_matching_cls = classmethod(is_matching_cls)
