"""What the OpInfo conformance tests share: which samples run, how inputs reach rgpu, how the
results are compared with the CPU's.

* **Samples.** A seeded random subset of each op's samples per dtype (`RGPU_CONFORMANCE_SAMPLES`,
  default 4; `all` runs every sample), drawn anew with `RGPU_CONFORMANCE_SEED` (default 0).
* **Inputs.** Tensors go to rgpu with `.to("rgpu")`, which, as `.to("cuda")` does, copies a view's
  visible elements only and lays a non-dense tensor out densely. The CPU reference runs on copies
  with exactly those layouts (`clone(memory_format=torch.preserve_format)`), so output strides can
  be compared. `device=` arguments name rgpu, so factories run there. Index tensors that an op
  reads on the host stay on the CPU (`KEEP_ON_CPU`), as CUDA requires.
* **Comparison.** Every tensor output must be on rgpu and have the CPU's dtype, shape and strides
  (where strides address memory: dims of size > 1 of a non-empty tensor);
  its values, and those of a transposed and a sliced view read back (views are made by the client
  from its predicted layout, so a wrong prediction shows there), must equal the CPU's bit for bit,
  except for the ops in `TOLERANCES`. A sample that raises on the CPU must raise on rgpu.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch
from torch.utils._pytree import tree_flatten, tree_map

torch_testing = pytest.importorskip("torch.testing._internal.common_methods_invocations")
op_db = torch_testing.op_db
# Each time an op's samples are drawn, torch looks up the stack for a unittest.TestCase to seed
# from (`extract_test_fn`: inspect.stack(), which reads every frame's source). Under pytest there
# is none, so the answer is always None; asking took 60% of an OpInfo sweep's time. The OpInfo
# core imports the function by name, so it is replaced there too.
for _module in ("common_utils", "opinfo.core"):
    _loaded = pytest.importorskip(f"torch.testing._internal.{_module}")
    if hasattr(_loaded, "extract_test_fn"):
        _loaded.extract_test_fn = lambda: None

SAMPLES = os.environ.get("RGPU_CONFORMANCE_SAMPLES", "4")
SEED = os.environ.get("RGPU_CONFORMANCE_SEED", "0")
HERE = Path(__file__).resolve().parent

# Ops whose values are garbage on both sides: only their layouts are compared.
UNINITIALISED = {"empty", "empty_like", "new_empty", "new_empty_strided", "empty_permuted", "empty_strided"}  # fmt: skip
# Tensor arguments an op reads on the host, by position in (input, *args): CUDA requires them on the CPU.
KEEP_ON_CPU = {"tensor_split": {1}}
# Ops allowed to differ from the CPU by rounding (assert_close's default tolerance for the dtype),
# with why. Everything else must be equal bit for bit.
_SUBCLASS_VECTORS = (
    "for a tensor subclass (rgpu's tensors are one) PyTorch computes the eigen/singular vectors "
    "too (_may_require_fw_or_bw_grad), and LAPACK's routine with vectors rounds differently"
)
# name: (why, assert_close tolerances; {} for its defaults for the dtype)
TOLERANCES: dict[str, tuple[str, dict]] = {
    "matmul": (
        "PyTorch's decomposition for tensor subclasses folds a batch of 1 into one mm where the "
        "CPU kernel runs bmm: the sums round differently",
        {},
    ),
    "__rmatmul__": ("as matmul", {}),
    "linalg.eigvalsh": (_SUBCLASS_VECTORS, {}),
    "linalg.svdvals": (_SUBCLASS_VECTORS, {}),
    "linalg.cond": (_SUBCLASS_VECTORS, {}),
    "linalg.matrix_norm": (_SUBCLASS_VECTORS + " (nuc and 2-norms)", {}),
    "norm.nuc": (_SUBCLASS_VECTORS, {}),
    "linalg.norm": (_SUBCLASS_VECTORS + " (matrix nuc and 2-norms)", {}),
    "prod": (
        "gradient: PyTorch's prod backward takes its out-of-place formula for tensor subclasses",
        {},
    ),
    "masked.prod": ("as prod", {}),
    "nn.functional.silu": (
        "gradient: with no rgpu kernel for silu_backward, PyTorch runs its "
        "CompositeImplicitAutograd math (sigmoid, mul, ...), the CPU its fused kernel",
        {},
    ),
    "nn.functional.mish": ("gradient: as nn.functional.silu, for mish_backward", {}),
    "linalg.lstsq": ("MKL's gelsy driver differs from call to call on the CPU itself", {}),
    "linalg.lstsq.grad_oriented": ("as linalg.lstsq", {}),
    "nn.functional.scaled_dot_product_attention": (
        "with a mask rgpu takes the math path (rgpu/attention.py fuses mask-free calls only), "
        "the CPU its fused kernel: a few ulps apart in bfloat16",
        {"rtol": 0.05, "atol": 0.01},
    ),
    "nn.functional.linear_cross_entropy.chunked": (
        "a torch_nn custom op: rgpu runs its aten decomposition, the CPU its own kernel, which "
        "accumulates reduced precision in another order (a few ulps)",
        {"rtol": 0.02, "atol": 0.01},
    ),
    "nn.functional.linear_cross_entropy.chunked_none": (
        "as linear_cross_entropy.chunked",
        {"rtol": 0.02, "atol": 0.01},
    ),
}


# Ops whose gradient PyTorch itself lays out otherwise for a tensor subclass (rgpu's tensors are
# one) than for a CPU tensor: their strides are not compared (values and views are).
SUBCLASS_LAYOUTS = {
    "ormqr": "the backward formula for subclasses returns `input`'s gradient row-major where "
    "the CPU's is column-major",
    "masked.prod": "prod's backward for subclasses hands AccumulateGrad an expanded gradient, "
    "which it keeps as the .grad",
}
# Ops that take or make sparse tensors: rgpu has dense (strided) tensors only. The pass rates
# are also given without them.
SPARSE = {"sparse.sampled_addmm", "sparse.mm.reduce", "to_sparse"}


def name_of(op) -> str:
    return op.name + ("." + op.variant_test_name if op.variant_test_name else "")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def read_xfails(path: str | Path) -> dict[str, str]:
    """`name: reason` or `name@dtype: reason` per line, `#` comments."""
    out = {}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, reason = line.split(":", 1)
            out[name.strip()] = reason.strip()
    return out


def params(ops_and_dtypes, xfails: dict[str, str]) -> list:
    """pytest params `name[dtype]`, strict xfail where the list names the op (or op@dtype)."""
    out = []
    for op, dtype in ops_and_dtypes:
        name = name_of(op)
        reason = xfails.get(f"{name}@{dtype_name(dtype)}", xfails.get(name))
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        out.append(pytest.param(op, dtype, id=f"{name}-{dtype_name(dtype)}", marks=marks))
    return out


def pick_samples(op, dtype: torch.dtype, requires_grad: bool) -> list:
    samples = list(op.sample_inputs("cpu", dtype, requires_grad=requires_grad))
    if SAMPLES == "all" or len(samples) <= int(SAMPLES):
        return samples
    rng = random.Random(f"{SEED}:{name_of(op)}:{dtype}:{requires_grad}")
    return [samples[i] for i in sorted(rng.sample(range(len(samples)), int(SAMPLES)))]


def _args_of(sample) -> tuple:
    return (sample.input, *sample.args)


def inputs_for(op, sample, device: str) -> tuple[list, dict]:
    """The sample's (args, kwargs) for `device`: "rgpu" (moved) or "cpu" (same layouts)."""
    keep = KEEP_ON_CPU.get(op.name, set())

    def move(x):
        if isinstance(x, torch.Tensor) and x.layout == torch.strided:
            if device == "rgpu":
                y = x.detach().to("rgpu")
            else:
                y = x.detach().clone(memory_format=torch.preserve_format)
            return y.requires_grad_(x.requires_grad)
        if device == "rgpu" and (x == "cpu" or (isinstance(x, torch.device) and x.type == "cpu")):
            return torch.device("rgpu")  # factories and .to() make rgpu tensors
        return x

    args = [a if i in keep else tree_map(move, a) for i, a in enumerate(_args_of(sample))]
    return args, {k: tree_map(move, v) for k, v in sample.kwargs.items()}


def run(op, args: list, kwargs: dict):
    torch.manual_seed(1234)
    return op(*args, **kwargs)


def run_and_read(op, args: list, kwargs: dict) -> None:
    """Run on rgpu and read every output back: rgpu reports a failure at the next wait, and a
    view made on the client (as_strided out of its storage's bounds) when it is read."""
    for t in tree_flatten(run(op, args, kwargs))[0]:
        if isinstance(t, torch.Tensor) and t.layout == torch.strided:
            t.cpu()
    torch.rgpu.synchronize()


def _views(t: torch.Tensor) -> list:
    """A transposed and a sliced view, made on the client from the output's layout."""
    out = []
    if t.dim() >= 2:
        out.append(lambda x: x.transpose(0, -1))
    big = [d for d in range(t.dim()) if t.shape[d] > 1]
    if big:
        d = big[-1]
        out.append(lambda x: x.narrow(d, 1, x.shape[d] - 1))
    return out


def on_rgpu(args: list, kwargs: dict) -> bool:
    """Whether the rgpu run involves rgpu at all (a sample of plain numbers stays on the CPU)."""
    leaves = tree_flatten((args, kwargs))[0]
    return any(
        (isinstance(x, torch.Tensor) or isinstance(x, torch.device)) and x.type == "rgpu"
        if isinstance(x, torch.device)
        else isinstance(x, torch.Tensor) and x.device.type == "rgpu"
        for x in leaves
    )


def assert_same(name: str, remote, expected, device: str = "rgpu", strides: bool = True) -> None:
    """rgpu's outputs equal the CPU's: devices, layouts, values, views (see the module doc).
    `device`: where outputs the CPU makes on the CPU must be; `strides`: compare them."""
    got, got_spec = tree_flatten(remote)
    want, want_spec = tree_flatten(expected)
    assert len(got) == len(want), f"{len(got)} outputs, the CPU gives {len(want)}"
    tol = TOLERANCES[name][1] if name in TOLERANCES else {"rtol": 0, "atol": 0}
    for i, (r, e) in enumerate(zip(got, want)):
        if not isinstance(e, torch.Tensor):
            if isinstance(e, float) and e != e:
                assert isinstance(r, float) and r != r, f"output {i}: {r!r}, the CPU gives nan"
            else:
                assert r == e and type(r) is type(e), f"output {i}: {r!r}, the CPU gives {e!r}"
            continue
        assert isinstance(r, torch.Tensor), (
            f"output {i}: {type(r).__name__}, the CPU gives a tensor"
        )
        want_device = device if e.device.type == "cpu" else e.device.type
        assert r.device.type == want_device, f"output {i} is on {r.device}, not {want_device}"
        layout = (r.dtype, tuple(r.shape), r.stride())
        assert _same_layout(r, e, strides), (
            f"output {i}: dtype/shape/strides {layout}, the CPU gives "
            f"{(e.dtype, tuple(e.shape), e.stride())}"
        )
        if e.layout != torch.strided or name in UNINITIALISED:
            continue
        torch.testing.assert_close(r.cpu(), e, equal_nan=True, msg=_prefix(f"output {i}"), **tol)
        for view in _views(e):
            torch.testing.assert_close(
                view(r).cpu(), view(e), equal_nan=True, msg=_prefix(f"a view of output {i}"), **tol
            )


def _same_layout(r: torch.Tensor, e: torch.Tensor, strides: bool = True) -> bool:
    """Same dtype and shape, and the same strides where they address memory: dims of size > 1
    of a non-empty tensor (torch._prims_common.check_significant_strides)."""
    if (r.dtype, r.shape) != (e.dtype, e.shape):
        return False
    return (
        not strides
        or e.numel() == 0
        or all(n == 1 or a == b for n, a, b in zip(e.shape, r.stride(), e.stride()))
    )


def _prefix(what: str):
    return lambda message: f"{what}: {message}"


def report(title: str, results: dict[tuple[str, str], bool]) -> dict[str, float]:
    """Print the pass rate per dtype, of all ops and of the dense ones; return the latter."""
    rates = {}
    lines = [f"\n{title} (RGPU_CONFORMANCE_SAMPLES={SAMPLES}, RGPU_CONFORMANCE_SEED={SEED}):"]
    for dtype in sorted({d for _, d in results}):
        oks = [ok for (_, d), ok in results.items() if d == dtype]
        dense = [ok for (n, d), ok in results.items() if d == dtype and n not in SPARSE]
        rates[dtype] = sum(dense) / len(dense)
        lines.append(
            f"  {dtype:>10}: {sum(oks)}/{len(oks)} ops match the CPU ({sum(oks) / len(oks):.2%}); "
            f"without the {len(oks) - len(dense)} sparse ones {sum(dense)}/{len(dense)} "
            f"({rates[dtype]:.2%})"
        )
    print("\n".join(lines))
    return rates
