"""Ops call PyTorch's generated bindings only where those make the overload's own call.

rgpu_server.bindings proves a binding equivalent per overload and argument types (the two calls
must reach the dispatcher identically). A wrong proof would run another overload, or convert an
argument differently, with no error: these tests run the binding and the overload's own callable
side by side on every aten call PyTorch's OpInfo samples make on the CPU, check the cases where a
binding must not be taken, and which callable a RUN and a replayed op get. End to end, the
conformance tests run every OpInfo op through a real server with bindings on.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from rgpu_server import bindings
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

aten = torch.ops.aten
VF = torch._C._VariableFunctions


def _clone(x):
    if isinstance(x, torch.Tensor) and x.layout == torch.strided:
        c = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype)
        c.copy_(x)
        return c
    return x


def _differs(a, b, values: bool = True) -> str | None:
    fa, fb = tree_flatten(a)[0], tree_flatten(b)[0]
    if len(fa) != len(fb):
        return "different outputs"
    for x, y in zip(fa, fb):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return "a tensor against a non-tensor"
        if not isinstance(x, torch.Tensor):
            if x != y and not (x != x and y != y):
                return f"{x!r} != {y!r}"
            continue
        if (x.dtype, x.shape, x.layout) != (y.dtype, y.shape, y.layout):
            return f"{x.dtype}{list(x.shape)} != {y.dtype}{list(y.shape)}"
        if x.layout == torch.strided and x.numel() and x.stride() != y.stride():
            return f"strides {x.stride()} != {y.stride()}"
        if (
            values
            and x.layout == torch.strided
            and not torch.equal(
                torch.view_as_real(x) if x.is_complex() else x,
                torch.view_as_real(y) if y.is_complex() else y,
            )
            and not (x.is_floating_point() and torch.allclose(x, y, 0, 0, equal_nan=True))
        ):
            return "values differ"
    return None


class CompareBindings(TorchDispatchMode):
    """Every call: where a binding is proved, run it and the overload's callable on copies of the
    arguments and compare outputs and written arguments bit for bit."""

    def __init__(self) -> None:
        super().__init__()
        self.checked: set = set()
        self.wrong: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = tree_flatten((args, kwargs))[0]
        if all(not isinstance(t, torch.Tensor) or t.layout == torch.strided for t in flat):
            fn = bindings.binding(func, args, kwargs)
            if fn is not None:
                results = []
                for call in (func._op, func._op, fn):
                    a, k = tree_map(_clone, args), tree_map(_clone, kwargs)
                    torch.default_generator.manual_seed(0)
                    try:
                        results.append((call(*a, **k), a, k))
                    except Exception as e:  # noqa: BLE001
                        results.append((type(e).__name__, None, None))
                # outputs the overload itself leaves different each call are garbage (empty)
                garbage = "empty" in func.name() or _differs(*results[:2])
                why = _differs(results[0], results[2], values=not garbage)
                if why:
                    self.wrong[str(func)] = f"{func}: {why}"
                self.checked.add(func)
        return func(*args, **kwargs)


def test_bindings_make_the_overloads_own_results_on_every_call_opinfo_samples_reach():
    import opinfo_harness  # noqa: F401  (no stack walk per sample)
    from torch.testing._internal.common_methods_invocations import op_db

    mode = CompareBindings()
    for op in op_db:
        if torch.float32 not in op.supported_dtypes("cpu"):
            continue
        for dtype in (torch.float32, torch.int64):
            if dtype not in op.supported_dtypes("cpu"):
                continue
            try:
                samples = list(itertools.islice(op.sample_inputs("cpu", dtype), 2))
            except Exception:  # noqa: BLE001
                continue
            for sample in samples:
                try:
                    with mode:
                        op(sample.input, *sample.args, **sample.kwargs)
                except Exception:  # noqa: BLE001  (the sample is invalid on the CPU)
                    continue
    assert len(mode.checked) > 250, len(mode.checked)
    assert not mode.wrong, "\n".join(mode.wrong.values())


def test_a_binding_is_taken_only_where_it_makes_the_same_call():
    x = torch.zeros(3, 4)
    assert bindings.binding(aten.add.Tensor, (x, x), {"alpha": 2}) is VF.add
    assert bindings.binding(aten.view.default, (x, [4, 3]), {}) is torch._C.TensorBase.view
    # torch.add(x, 2) makes add.Tensor (a wrapped number), not add.Scalar
    assert bindings.binding(aten.add.Scalar, (x, 2), {}) is None
    # no binding of that name, or only one that calls another op
    assert bindings.binding(aten.slice.Tensor, (x, 0, 0, 2, 1), {}) is None
    # a binding of another op is never proved for this one, nor one given a 0-dim tensor where
    # the overload takes a number
    assert not bindings._proved(aten.add.Tensor, VF.sub, (x, x), {}, 2)
    assert not bindings._proved(aten.add.Scalar, VF.add, (x, x), {}, 2)


def test_an_int_tensor_and_a_float_number_promote_as_the_overload_does():
    i = torch.arange(6).reshape(2, 3)
    fn = bindings.binding(aten.add.Tensor, (i, 2.5), {})
    assert fn is VF.add
    got, want = fn(i, 2.5), aten.add.Tensor._op(i, 2.5)
    assert got.dtype == want.dtype == torch.float32 and torch.equal(got, want)
    zero_dim = torch.tensor(2.5, dtype=torch.float64)
    fn = bindings.binding(aten.mul.Tensor, (i, zero_dim), {})
    got, want = fn(i, zero_dim), aten.mul.Tensor._op(i, zero_dim)
    assert got.dtype == want.dtype and torch.equal(got, want)


def test_runs_and_replayed_ops_call_the_proved_binding_and_lists_the_ops_own():
    from rgpu_server.ops import resolve
    from rgpu_server.replay import SeqOp

    from rgpu_protocol.slots import Slot, SlotKind

    x = torch.zeros(2, 3)
    add = resolve("add.Tensor")
    key = (torch.Tensor, int)
    assert bindings.by_types(add, [x, 1], key) is VF.add
    assert add.by_types[key] is VF.add
    view = resolve("view.default")
    assert bindings.by_types(view, [x, [3, 2]], (torch.Tensor, list)) is view.call
    op = SeqOp(["add.Tensor", [Slot(SlotKind.INPUT, 0), 1], None, [0], None])
    assert op.call is VF.add
    # an op the server runs with a kernel of its own keeps it
    lstm = resolve("lstm.input")
    assert bindings.by_types(lstm, [x], (torch.Tensor,)) is lstm.call is not lstm.op._op


def test_past_its_caps_an_op_keeps_its_own_callable_and_proves_nothing(monkeypatch):
    from rgpu_server.ops import ResolvedOp, resolve

    x = torch.zeros(2)
    mul = resolve("mul.Tensor")
    fresh = ResolvedOp(mul.op, mul.label, False, False, (), call=mul.call, plain=True)
    monkeypatch.setattr(bindings, "_MAX_TYPES_PER_OP", 0)
    assert bindings.by_types(fresh, [x, 2.0], (torch.Tensor, float)) is mul.call
    assert fresh.by_types == {}
    monkeypatch.setattr(bindings, "_found", {})
    monkeypatch.setattr(bindings, "_MAX_KEYS", 0)
    monkeypatch.setattr(bindings, "_proved", lambda *a: pytest.fail("proved past the cap"))
    assert bindings.binding(aten.mul.Tensor, (x, 2.0), {}) is None
