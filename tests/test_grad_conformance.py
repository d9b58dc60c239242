"""Gradient conformance with PyTorch's OpInfo database: for every op that supports autograd, in
float32 and float64, the inputs' gradients (`.grad` after `backward()` of the summed outputs) on
rgpu must equal the CPU's, bit for bit (except the ops in opinfo_harness.TOLERANCES), with the
CPU's strides, and read the same through a transposed and a sliced view.

Samples and inputs are chosen and moved as in test_conformance.py (tests/opinfo_harness.py).
Expected failures are listed, with reasons, in grad_conformance_xfail.txt.
"""

from __future__ import annotations

import pytest
import torch
from opinfo_harness import (
    HERE,
    SUBCLASS_LAYOUTS,
    assert_same,
    inputs_for,
    name_of,
    op_db,
    params,
    pick_samples,
    read_xfails,
    report,
    run,
)
from torch.utils._pytree import tree_flatten

DTYPES = [torch.float32, torch.float64]
XFAIL = read_xfails(HERE / "grad_conformance_xfail.txt")
CASES = [
    (op, dtype)
    for dtype in DTYPES
    for op in op_db
    if op.supports_autograd and dtype in op.supported_dtypes("cpu")
]
RESULTS: dict[tuple[str, str], bool] = {}


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


def _grads(op, args: list, kwargs: dict):
    leaves = [
        t
        for t in tree_flatten((args, kwargs))[0]
        if isinstance(t, torch.Tensor) and t.requires_grad
    ]
    loss = _scalar_loss(run(op, args, kwargs))
    if loss is None or not leaves:
        return None
    return list(torch.autograd.grad(loss, leaves, allow_unused=True))


def grads_both_ways(op, dtype: torch.dtype) -> int:
    compared = 0
    for sample in pick_samples(op, dtype, requires_grad=True):
        try:
            expected = _grads(op, *inputs_for(op, sample, "cpu"))
        except Exception:
            continue  # invalid on the CPU too (the forward test checks that rgpu refuses it)
        if expected is None:
            continue
        got = _grads(op, *inputs_for(op, sample, "rgpu"))
        torch.rgpu.synchronize()
        name = name_of(op)
        assert_same(name, got, expected, strides=name not in SUBCLASS_LAYOUTS)
        compared += 1
    return compared


@pytest.mark.parametrize("op, dtype", params(CASES, XFAIL))
def test_op_gradients_match_cpu(dev, op, dtype):
    key = (name_of(op), str(dtype).removeprefix("torch."))
    RESULTS[key] = False
    if grads_both_ways(op, dtype) == 0:
        del RESULTS[key]
        pytest.skip("no sample has a differentiable output on the CPU")
    RESULTS[key] = True


def test_gradient_pass_rate_per_dtype(dev):
    if len(RESULTS) < len(CASES) // 2:
        pytest.skip("run the whole module to get the pass rates")
    rates = report("OpInfo gradient conformance", RESULTS)
    assert rates.get("float32", 1.0) >= 0.995  # of the dense ops; -k may leave float32 out
    assert rates.get("float64", 1.0) >= 0.995
    unexpected = sorted(
        f"{n}@{d}"
        for (n, d), ok in RESULTS.items()
        if not ok and n not in XFAIL and f"{n}@{d}" not in XFAIL
    )
    assert not unexpected
