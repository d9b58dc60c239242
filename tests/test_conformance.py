"""Conformance with PyTorch's own OpInfo database: every op whose CPU dtypes include float32.

For each op, its first samples run on the CPU and on rgpu (from the same seed, so random ops are
comparable: a CPU server draws what local CPU torch draws) and the results must match. Expected
failures are listed, with reasons, in conformance_xfail.txt.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_map
from xfail_lists import read_xfails

torch_testing = pytest.importorskip("torch.testing._internal.common_methods_invocations")
op_db = torch_testing.op_db

SAMPLES = 3
UNINITIALISED = {
    "empty",
    "empty_like",
    "new_empty",
    "new_empty_strided",
    "empty_permuted",
    "empty_strided",
}
XFAIL_FILE = __file__.rsplit("/", 1)[0] + "/conformance_xfail.txt"


XFAIL = read_xfails(XFAIL_FILE)
OPS = [op for op in op_db if torch.float32 in op.supported_dtypes("cpu")]


def _name(op) -> str:
    return op.name + ("." + op.variant_test_name if op.variant_test_name else "")


def _to(device):
    def move(x):
        if isinstance(x, torch.Tensor) and x.layout == torch.strided:
            return x.to(device)
        return x

    return move


def _cpu(x):
    return x.cpu() if isinstance(x, torch.Tensor) and x.device.type == "rgpu" else x


def _meta(x):
    return (x.shape, x.dtype, x.stride()) if isinstance(x, torch.Tensor) else x


def run_op_both_ways(op) -> int:
    """Run the op's first samples on CPU and rgpu; return how many samples were compared."""
    compared = 0
    for sample in list(op.sample_inputs("cpu", torch.float32, requires_grad=False))[:SAMPLES]:
        try:
            torch.manual_seed(1234)
            expected = op(sample.input, *sample.args, **sample.kwargs)
        except Exception:
            continue  # the sample is invalid on the CPU too
        torch.manual_seed(1234)
        rin, rargs, rkwargs = tree_map(_to("rgpu"), (sample.input, sample.args, sample.kwargs))
        remote = op(rin, *rargs, **rkwargs)
        # a sample may copy to the CPU with non_blocking=True: as with CUDA, its values may be read
        # only after a synchronize
        torch.rgpu.synchronize()
        if op.name in UNINITIALISED:  # values are garbage on both sides: compare layouts
            assert tree_map(_meta, remote) == tree_map(_meta, expected)
        else:
            got = tree_map(_cpu, remote)
            torch.testing.assert_close(
                got, expected, equal_nan=True, rtol=1e-4, atol=1e-5, check_device=False
            )
        compared += 1
    return compared


RESULTS: dict[str, bool] = {}


@pytest.mark.parametrize(
    "op",
    [pytest.param(op, id=_name(op), marks=[pytest.mark.xfail(strict=True, reason=XFAIL[_name(op)])] if _name(op) in XFAIL else [])
     for op in OPS],
)  # fmt: skip
def test_op_matches_cpu(dev, op):
    name = _name(op)
    try:
        compared = run_op_both_ways(op)
    except BaseException:
        RESULTS[name] = False
        raise
    if compared == 0:
        RESULTS.pop(name, None)
        pytest.skip("every sample raises on the CPU too")
    RESULTS[name] = True


def test_pass_rate_is_at_least_99_percent(dev):
    if len(RESULTS) < len(OPS) // 2:
        pytest.skip("run the whole conformance module to get the pass rate")
    passed = sum(RESULTS.values())
    rate = passed / len(RESULTS)
    print(f"\nOpInfo conformance: {passed}/{len(RESULTS)} ops match the CPU ({rate:.2%})")
    assert rate >= 0.99
    unexpected = sorted(n for n, ok in RESULTS.items() if not ok and n not in XFAIL)
    assert not unexpected
