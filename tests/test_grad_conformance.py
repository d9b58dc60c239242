"""Gradient conformance with PyTorch's OpInfo database: for ops that support autograd, float32,
the input gradients of the summed outputs on rgpu must equal those on the CPU.

Expected failures are listed, with reasons, in grad_conformance_xfail.txt.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_flatten, tree_map
from xfail_lists import read_xfails

torch_testing = pytest.importorskip("torch.testing._internal.common_methods_invocations")
op_db = torch_testing.op_db

SAMPLES = 2
XFAIL_FILE = __file__.rsplit("/", 1)[0] + "/grad_conformance_xfail.txt"


XFAIL = read_xfails(XFAIL_FILE)
OPS = [op for op in op_db if op.supports_autograd and torch.float32 in op.supported_dtypes("cpu")]


def _name(op) -> str:
    return op.name + ("." + op.variant_test_name if op.variant_test_name else "")


def _move(device):
    def move(x):
        if isinstance(x, torch.Tensor) and x.layout == torch.strided:
            return x.detach().to(device).requires_grad_(x.requires_grad)
        return x

    return move


def _scalar_loss(out) -> torch.Tensor | None:
    total = None
    for o in tree_flatten(out)[0]:
        if (
            isinstance(o, torch.Tensor)
            and o.requires_grad
            and (o.is_floating_point() or o.is_complex())
        ):
            term = torch.view_as_real(o).sum() if o.is_complex() else o.sum()
            total = term if total is None else total + term
    return total


def _grads(op, sample, device):
    torch.manual_seed(1234)
    inp, args, kwargs = tree_map(_move(device), (sample.input, sample.args, sample.kwargs))
    leaves = [
        t
        for t in tree_flatten((inp, args, kwargs))[0]
        if isinstance(t, torch.Tensor) and t.requires_grad
    ]
    loss = _scalar_loss(op(inp, *args, **kwargs))
    if loss is None or not leaves:
        return None
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return [None if g is None else g.cpu() for g in grads]


RESULTS: dict[str, bool] = {}


@pytest.mark.parametrize(
    "op",
    [pytest.param(op, id=_name(op), marks=[pytest.mark.xfail(strict=True, reason=XFAIL[_name(op)])] if _name(op) in XFAIL else [])
     for op in OPS],
)  # fmt: skip
def test_op_gradients_match_cpu(dev, op):
    name = _name(op)
    compared = 0
    try:
        for sample in list(op.sample_inputs("cpu", torch.float32, requires_grad=True))[:SAMPLES]:
            try:
                expected = _grads(op, sample, "cpu")
            except Exception:
                continue  # invalid on the CPU too
            if expected is None:
                continue
            got = _grads(op, sample, "rgpu")
            torch.testing.assert_close(got, expected, equal_nan=True, rtol=1e-4, atol=1e-5)
            compared += 1
    except BaseException:
        RESULTS[name] = False
        raise
    if compared == 0:
        pytest.skip("no sample has a differentiable output on the CPU")
    RESULTS[name] = True


def test_gradient_pass_rate_is_at_least_99_percent(dev):
    if len(RESULTS) < len(OPS) // 2:
        pytest.skip("run the whole module to get the pass rate")
    passed = sum(RESULTS.values())
    rate = passed / len(RESULTS)
    print(f"\nOpInfo gradient conformance: {passed}/{len(RESULTS)} ops match the CPU ({rate:.2%})")
    assert rate >= 0.99
    assert not sorted(n for n, ok in RESULTS.items() if not ok and n not in XFAIL)
