"""Conformance with PyTorch's own OpInfo database, forward: every op, in float32, bfloat16,
float16, int64, bool and complex64 wherever the CPU supports the dtype.

Each sample runs on the CPU and on rgpu from the same seed (a CPU server draws what local CPU
torch draws) and the results must be the same: values bit for bit, devices, strides and views
(tests/opinfo_harness.py says how). Expected failures are listed, with reasons, in
conformance_xfail.txt; the rate per dtype is printed by the last test and kept in the README.

    python -m pytest tests/test_conformance.py                                # 4 samples per op and dtype
    RGPU_CONFORMANCE_SAMPLES=all python -m pytest tests/test_conformance.py   # every sample
    RGPU_CONFORMANCE_SEED=7 python -m pytest tests/test_conformance.py        # another subset
"""

from __future__ import annotations

import pytest
import torch
from opinfo_harness import (
    HERE,
    assert_same,
    inputs_for,
    name_of,
    on_rgpu,
    op_db,
    params,
    pick_samples,
    read_xfails,
    report,
    run,
    run_and_read,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.complex64]
XFAIL = read_xfails(HERE / "conformance_xfail.txt")
CASES = [(op, dtype) for dtype in DTYPES for op in op_db if dtype in op.supported_dtypes("cpu")]
RESULTS: dict[tuple[str, str], bool] = {}


def run_both_ways(op, dtype: torch.dtype) -> int:
    """Run the op's samples on the CPU and on rgpu; return how many were compared."""
    compared = 0
    for sample in pick_samples(op, dtype, requires_grad=False):
        args, kwargs = inputs_for(op, sample, "cpu")
        try:
            expected = run(op, args, kwargs)
        except Exception as e:  # the sample is invalid: rgpu must refuse it too
            try:
                run_and_read(op, *inputs_for(op, sample, "rgpu"))
            except Exception:
                compared += 1
                continue
            raise AssertionError(f"the CPU raises {e!r}, rgpu returns a result") from None
        rargs, rkwargs = inputs_for(op, sample, "rgpu")
        remote = run(op, rargs, rkwargs)
        # a sample may copy to the CPU with non_blocking=True: as with CUDA, its values may be read
        # only after a synchronize
        torch.rgpu.synchronize()
        assert_same(name_of(op), remote, expected, "rgpu" if on_rgpu(rargs, rkwargs) else "cpu")
        compared += 1
    return compared


@pytest.mark.parametrize("op, dtype", params(CASES, XFAIL))
def test_op_matches_cpu(dev, op, dtype):
    key = (name_of(op), str(dtype).removeprefix("torch."))
    RESULTS[key] = False
    if run_both_ways(op, dtype) == 0:
        del RESULTS[key]
        pytest.skip("the op has no sample in this dtype")
    RESULTS[key] = True


def test_pass_rate_per_dtype(dev):
    if len(RESULTS) < len(CASES) // 2:
        pytest.skip("run the whole conformance module to get the pass rates")
    rates = report("OpInfo forward conformance", RESULTS)
    assert rates.get("float32", 1.0) >= 0.995  # of the dense ops; -k may leave float32 out
    unexpected = sorted(
        f"{n}@{d}"
        for (n, d), ok in RESULTS.items()
        if not ok and n not in XFAIL and f"{n}@{d}" not in XFAIL
    )
    assert not unexpected
