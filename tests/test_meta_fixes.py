"""Predicted layouts are the server's: rgpu/meta_fixes.py against the CPU's kernels.

The client builds views of an op's outputs from its predicted layout, so a wrong prediction reads
wrong elements without an error. Without a server, every aten op that PyTorch's OpInfo samples
reach (its first two samples, forward in float32 and bfloat16, backward in float32 from the summed
outputs and from gradients laid out transposed), and pointwise ops on random layouts
(transposed, expanded, broadcast, sliced, empty), must be predicted with the CPU's dtype, shape
and strides where they address memory. Ops that learn their layout from the server
(`meta_fixes.must_ask_server`) are left out. End to end, the issue's own examples read the right
numbers through views.
"""

from __future__ import annotations

import itertools
import os
import random
import re
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

import rgpu
from rgpu import in_place_meta, meta_fixes, strides

torch_testing = pytest.importorskip("torch.testing._internal.common_methods_invocations")
import opinfo_harness  # noqa: E402,F401  (draws samples without torch's stack walk)


def _meta_like(x):
    if isinstance(x, torch.Tensor) and x.layout == torch.strided and x.device.type == "cpu":
        m = torch.empty(0, dtype=x.dtype, device="meta")
        storage = torch.empty(x.untyped_storage().nbytes(), dtype=torch.uint8, device="meta")
        m.set_(storage.untyped_storage(), x.storage_offset(), x.shape, x.stride())
        torch._C._set_conj(m, x.is_conj())
        torch._C._set_neg(m, x.is_neg())
        return m
    if isinstance(x, torch.device) and x.type == "cpu":
        return torch.device("meta")
    return x


def _layout_differs(real: torch.Tensor, predicted: torch.Tensor) -> bool:
    if (real.dtype, real.shape, real.storage_offset()) != (
        predicted.dtype,
        predicted.shape,
        predicted.storage_offset(),
    ):
        return True
    return real.numel() > 0 and any(
        n > 1 and a != b for n, a, b in zip(real.shape, real.stride(), predicted.stride())
    )


class PredictEveryOp(TorchDispatchMode):
    """Runs each aten op on the CPU and predicts it on meta, as rgpu's dispatch does."""

    def __init__(self) -> None:
        super().__init__()
        self.wrong: dict[str, str] = {}

    def __torch_dispatch__(self, func, types, args, kwargs=None):
        kwargs = kwargs or {}
        margs, mkwargs = tree_map(_meta_like, (args, kwargs))  # before an in-place op runs
        out = func(*args, **kwargs)
        name = func.__name__.split(".")[0]
        if func.namespace != "aten" or meta_fixes.must_ask_server(func, args):
            return out
        try:
            predicted = meta_fixes.run_meta(func, margs, mkwargs, "cpu")
        except Exception:
            return out  # no meta kernel: rgpu asks the server (RUN_DYN)
        got, want = tree_flatten(out)[0], tree_flatten(predicted)[0]
        for i, (r, m) in enumerate(zip(got, want)):
            if (
                isinstance(r, torch.Tensor)
                and r.layout == torch.strided
                and isinstance(m, torch.Tensor)
            ):
                if _layout_differs(r, m):
                    self.wrong.setdefault(
                        str(func),
                        f"{name} output {i}: CPU {r.dtype} {tuple(r.shape)} {r.stride()}, "
                        f"predicted {m.dtype} {tuple(m.shape)} {m.stride()}",
                    )
        return out


def _samples(op, dtype, requires_grad: bool, k: int = 2) -> list:
    return list(itertools.islice(op.sample_inputs("cpu", dtype, requires_grad=requires_grad), k))


def _transposed_gradient(o: torch.Tensor, order: str) -> torch.Tensor:
    """A gradient of `o`'s shape laid out with its dims reversed or its first two swapped: what a
    transpose after the op hands its backward (Swin's pooling, a layer norm's output)."""
    if o.dim() < 2:
        return torch.randn(o.shape, dtype=o.dtype)
    perm = list(range(o.dim()))[::-1] if order == "reversed" else [1, 0, *range(2, o.dim())]
    return torch.randn([o.shape[p] for p in perm], dtype=o.dtype).permute(*perm)


def _reversed(x):
    """`x` with the same values, laid out with its dims reversed (a transposed input)."""
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.layout != torch.strided:
        return x
    dims = list(range(x.dim()))[::-1]
    y = x.detach().permute(*dims).contiguous().permute(*dims)
    return y.requires_grad_(x.requires_grad)


def _loss(out):
    terms = [
        (torch.view_as_real(o) if o.is_complex() else o).sum()
        for o in tree_flatten(out)[0]
        if isinstance(o, torch.Tensor) and o.requires_grad
    ]
    return sum(terms) if terms else None


@pytest.mark.parametrize(
    "dtype, grad",
    [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True),
     (torch.float32, "reversed"), (torch.float32, "swapped"), (torch.float32, "inputs-reversed")],
    ids=["float32", "bfloat16", "float32-backward", "backward-of-a-reversed-gradient",
         "backward-of-a-swapped-gradient", "transposed-inputs-and-gradients"],
)  # fmt: skip
def test_every_op_the_opinfo_samples_reach_is_predicted_with_the_cpus_layout(dtype, grad):
    """Found this way: Swin's gradients (a transposed gradient); the gradient of a Huber loss,
    `logsigmoid` and `torch.normal` of transposed inputs."""
    mode = PredictEveryOp()
    ran = 0
    for op in torch_testing.op_db:
        if dtype not in op.supported_dtypes("cpu") or (grad and not op.supports_autograd):
            continue
        for sample in _samples(op, dtype, bool(grad), k=4 if grad == "inputs-reversed" else 2):
            if grad == "inputs-reversed":
                sample = sample.transform(_reversed)
            try:
                with mode:
                    out = op(sample.input, *sample.args, **sample.kwargs)
                    loss = _loss(out) if grad else None
                    leaves = [
                        t
                        for t in tree_flatten((sample.input, sample.args, sample.kwargs))[0]
                        if isinstance(t, torch.Tensor) and t.requires_grad
                    ]
                    if loss is not None and leaves and grad is True:
                        torch.autograd.grad(loss, leaves, allow_unused=True)
                    elif loss is not None and leaves:
                        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)
                                and o.requires_grad and o.is_floating_point()]  # fmt: skip
                        order = "reversed" if grad == "inputs-reversed" else grad
                        grads = [_transposed_gradient(o, order) for o in outs]
                        torch.autograd.grad(outs, leaves, grads, allow_unused=True)
                ran += 1
            except Exception:
                continue  # the sample is invalid on the CPU
    assert ran > 400
    assert not mode.wrong, "\n".join(mode.wrong.values())


def _random_layout(rng: random.Random, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of `shape` laid out at random: permuted, expanded, sliced, or contiguous."""
    n = len(shape)
    perm = list(range(n))
    rng.shuffle(perm)
    kind = rng.choice(["contiguous", "permuted", "expanded", "sliced"])
    if kind == "contiguous":
        perm = list(range(n))
    physical = [shape[d] for d in perm]
    if kind == "expanded":
        physical = [1 if rng.random() < 0.4 else s for s in physical]
    base = torch.zeros([2 * s for s in physical] if kind == "sliced" else physical, dtype=dtype)
    if kind == "sliced":
        base = base[tuple(slice(None, None, 2) for _ in physical)]
    return base.permute([perm.index(d) for d in range(n)]).expand(shape)


POINTWISE = sorted(
    (
        op
        for name in dir(torch.ops.aten)
        if hasattr(packet := getattr(torch.ops.aten, name), "overloads")
        for op in (getattr(packet, o) for o in packet.overloads())
        if meta_fixes._follows_tensor_iterator(op)
        and not torch._C._dispatch_has_kernel_for_dispatch_key(
            op.name(), "CompositeImplicitAutograd"
        )
    ),
    key=str,
)


def _random_shape(rng) -> list[int]:
    """Up to 4 dims of 1-4, now and then an empty one."""
    return [
        rng.choice([1, 2, 3, 4] if rng.random() > 0.1 else [0, 1, 3])
        for _ in range(rng.randint(0, 4))
    ]


def _arguments(rng, op, dtype, shape):
    args = []
    for a in op._schema.arguments:
        kind = str(a.type)
        if a.kwarg_only or (a.has_default_value() and "Tensor" not in kind):
            break
        if kind in ("Tensor", "Tensor?"):
            k = rng.randint(0, len(shape))
            sub = [1 if rng.random() < 0.3 else d for d in shape[len(shape) - k :]]
            t_dtype = torch.bool if a.name in ("condition", "mask") else dtype
            args.append(_random_layout(rng, sub if rng.random() < 0.6 else shape, t_dtype))
        elif kind in ("Scalar", "number", "float"):
            args.append(0.5 if dtype.is_floating_point else 2)
        elif kind in ("int", "SymInt"):
            args.append(1)
        elif kind == "bool":
            args.append(False)
        else:
            return None
    return args


def test_pointwise_ops_on_random_layouts_are_predicted_with_the_cpus_strides():
    rng = random.Random(0)
    dtypes = [
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.int64,
        torch.bool,
        torch.complex64,
    ]
    wrong, compared = {}, 0
    for _ in range(6000):
        op = rng.choice(POINTWISE)
        dtype = rng.choice(dtypes)
        args = _arguments(rng, op, dtype, _random_shape(rng))
        if args is None or meta_fixes.must_ask_server(op, tuple(args)):
            continue
        try:
            real = op(*args)
        except Exception:
            continue  # not a valid call
        try:
            predicted = meta_fixes.run_meta(op, tuple(_meta_like(a) for a in args), {}, "cpu")
        except Exception:
            continue  # no meta kernel (equal): rgpu asks the server; or a loud meta error
        compared += 1
        for r, m in zip(tree_flatten(real)[0], tree_flatten(predicted)[0]):
            if isinstance(r, torch.Tensor) and _layout_differs(r, m):
                wrong.setdefault(
                    str(op),
                    [
                        (tuple(a.shape), a.stride()) if isinstance(a, torch.Tensor) else a
                        for a in args
                    ],
                )
    assert compared > 2000
    assert not wrong, wrong


# -- out= tensors: resized ones laid out as the CPU lays them out, others kept -----------------

OUT_KINDS = ["empty", "wrong-size", "right-size-reversed"]


def _out_like(kind: str, t: torch.Tensor) -> torch.Tensor:
    if kind == "empty":
        return torch.empty(0, dtype=t.dtype)
    if kind == "wrong-size":
        return torch.empty(7, 2, dtype=t.dtype)
    dims = list(range(t.dim()))[::-1]
    return torch.empty([t.shape[d] for d in dims], dtype=t.dtype).permute(dims)


def _channels_last(x):
    if isinstance(x, torch.Tensor) and x.dim() == 4 and x.layout == torch.strided:
        y = x.detach().contiguous(memory_format=torch.channels_last)
        return y.requires_grad_(x.requires_grad)
    return _reversed(x)


def test_every_out_overload_the_opinfo_samples_reach_lays_out_out_as_the_cpu():
    """An out= tensor the op resizes takes the layout the CPU's kernel computes from the inputs
    (a transposed or channels-last input's, or column-major for LAPACK's), not row-major; one of
    the right shape keeps its own strides (sort's meta kernel restrided it)."""
    mode = PredictEveryOp()
    ran = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "An output with one or more elements was resized"
        for op in torch_testing.op_db:
            if not op.supports_out or torch.float32 not in op.supported_dtypes("cpu"):
                continue
            for sample, layout in itertools.product(
                _samples(op, torch.float32, False, k=4), (_reversed, _channels_last)
            ):
                sample = sample.transform(layout)
                try:
                    result = op(sample.input, *sample.args, **sample.kwargs)
                except Exception:
                    continue  # the sample is invalid on the CPU
                flat = tree_flatten(result)[0]
                if not flat or not all(isinstance(t, torch.Tensor) for t in flat):
                    continue
                for kind in OUT_KINDS:
                    outs = [_out_like(kind, t) for t in flat]
                    out = outs[0] if isinstance(result, torch.Tensor) else tuple(outs)
                    try:
                        with mode:
                            op(sample.input, *sample.args, **sample.kwargs, out=out)
                        ran += 1
                    except Exception:
                        continue
    assert ran > 5000
    assert not mode.wrong, "\n".join(mode.wrong.values())


OUT_OVERLOADS = {
    f: op
    for op in POINTWISE
    for packet in [getattr(torch.ops.aten, op._schema.name.split("::", 1)[1])]
    for f in (getattr(packet, o) for o in packet.overloads())
    if torch.Tag.out in f.tags
    and [(a.name, str(a.type)) for a in f._schema.arguments if not a.is_out]
    == [(a.name, str(a.type)) for a in op._schema.arguments]
}


def test_out_overloads_of_pointwise_ops_on_random_layouts_lay_out_out_as_the_cpu():
    rng = random.Random(1)
    dtypes = [torch.float16, torch.float32, torch.int64, torch.bool, torch.complex64]
    wrong, compared = {}, 0
    overloads = sorted(OUT_OVERLOADS, key=str)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(5000):
            func = rng.choice(overloads)
            op = OUT_OVERLOADS[func]
            dtype = rng.choice(dtypes)
            args = _arguments(rng, op, dtype, _random_shape(rng))
            if args is None or meta_fixes.must_ask_server(func, tuple(args)):
                continue  # ldexp, mvlgamma: RUN_DYN, whose reply lays `out` out
            try:
                result = op(*args)
            except Exception:
                continue  # not a valid call
            kind = rng.choice(OUT_KINDS)
            names = [a.name for a in func._schema.arguments if a.is_out]
            outs = dict(zip(names, (_out_like(kind, t) for t in tree_flatten(result)[0])))
            meta_outs = {k: _meta_like(v) for k, v in outs.items()}
            try:
                func(*args, **outs)
            except Exception:
                continue  # the out= overload refuses it (a dtype it cannot cast to)
            try:
                meta_fixes.run_meta(func, tuple(_meta_like(a) for a in args), meta_outs, "cpu")
            except Exception:
                continue  # rgpu asks the server (RUN_DYN), or a loud meta error
            compared += 1
            for name in names:
                if _layout_differs(outs[name], meta_outs[name]):
                    wrong.setdefault(
                        f"{func} ({kind})",
                        (
                            [(tuple(a.shape), a.stride()) if isinstance(a, torch.Tensor) else a
                             for a in args],
                            outs[name].stride(),
                            meta_outs[name].stride(),
                        ),
                    )  # fmt: skip
    assert compared > 2500
    assert not wrong, wrong


# -- shifts and pow of bools: the meta kernels' dtypes and refusals are not the CPU's ----------


def _predict(func, *args):
    return meta_fixes.run_meta(func, tuple(_meta_like(a) for a in args), {}, "cpu")


SHIFT_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int32, torch.int64, torch.float32]


@pytest.mark.parametrize(
    "name", ["__lshift__", "__rshift__", "__ilshift__", "__irshift__"]
)  # fmt: skip
def test_shifts_are_predicted_with_the_cpus_dtype_or_left_to_the_server(name):
    """`bool_tensor << 1` is int64 on the CPU; the dunders' meta kernels refused every bool."""
    packet = getattr(torch.ops.aten, name)
    compared = 0
    for dtype, other in itertools.product(SHIFT_DTYPES, [*SHIFT_DTYPES, 1, True, 2.0]):
        x = torch.tensor([[1, 0, 3], [2, 1, 0]]).to(dtype).t()
        if isinstance(other, torch.dtype):
            func, exp = packet.Tensor, torch.tensor([1, 2]).to(other)
        else:
            func, exp = packet.Scalar, other
        try:
            real = func(x.clone(), exp)
        except NotImplementedError:
            with pytest.raises(NotImplementedError):  # planned RUN_DYN: the server raises it
                _predict(func, x.clone(), exp)
            continue
        except RuntimeError as e:
            with pytest.raises(RuntimeError, match=re.escape(str(e))):
                _predict(func, x.clone(), exp)
            continue
        predicted = _predict(func, x.clone(), exp)
        assert (predicted.dtype, predicted.shape) == (real.dtype, real.shape), (dtype, other)
        assert predicted.stride() == real.stride(), (dtype, other)
        compared += 1
    assert compared > 20


@pytest.mark.parametrize("exponent", [True, False, 0, 1, 2, 2.0, 0.5, 1j])
def test_pow_of_a_bool_tensor_is_predicted_with_the_cpus_dtype(exponent):
    """`torch.pow(bool_tensor, True)` is bool on the CPU (a copy; `False` fills ones); the meta
    kernel said int64, so the client's tensor disagreed with the server's."""
    b = torch.tensor([[True, False, True], [False, True, True]]).t()
    real = torch.pow(b, exponent)
    predicted = _predict(torch.ops.aten.pow.Tensor_Scalar, b, exponent)
    assert (predicted.dtype, predicted.shape, predicted.stride()) == (
        real.dtype,
        real.shape,
        real.stride(),
    )
    # in place and out=, as the CPU does them (or refuses them)
    inplace = torch.ops.aten.pow_.Scalar
    try:
        b.clone().pow_(exponent)
    except RuntimeError:  # "result type Long can't be cast to the desired output type Bool"
        with pytest.raises(RuntimeError, match="cast"):
            in_place_meta.check_result_type(inplace, (_meta_like(b), exponent), {})
            _predict(inplace, b.clone(), exponent)
    else:
        in_place_meta.check_result_type(inplace, (_meta_like(b), exponent), {})
        predicted = _predict(inplace, b.clone(), exponent)
        assert (predicted.dtype, predicted.stride()) == (torch.bool, b.stride())
    for dtype in (torch.bool, torch.int32, torch.float32):
        out, meta_out = torch.empty(0, dtype=dtype), torch.empty(0, dtype=dtype, device="meta")
        try:
            torch.pow(b, exponent, out=out)
        except RuntimeError:
            continue
        meta_fixes.run_meta(
            torch.ops.aten.pow.Tensor_Scalar_out,
            (_meta_like(b), exponent),
            {"out": meta_out},
            "cpu",
        )
        assert (meta_out.dtype, meta_out.shape, meta_out.stride()) == (
            out.dtype,
            out.shape,
            out.stride(),
        )


def test_pows_the_cpu_refuses_in_bool_are_left_to_the_server():
    b = torch.tensor([True, False])
    for func, args in [
        (torch.ops.aten.pow.Tensor_Tensor, (b, b)),
        (torch.ops.aten.pow.Tensor_Tensor, (b, torch.tensor(True))),
        (torch.ops.aten.pow.Scalar, (True, b)),
        (torch.ops.aten.pow_.Tensor, (b.clone(), b)),
    ]:
        with pytest.raises(NotImplementedError):
            func(*args)
        with pytest.raises(NotImplementedError):  # planned RUN_DYN, where the server raises it
            _predict(func, *args)


def test_tensor_iterator_strides_follow_the_layout_of_the_decisive_input():
    tis = strides.tensor_iterator_strides
    assert tis([((2, 3), (3, 1)), ((2, 3), (3, 1))], (2, 3)) == (3, 1)  # contiguous fast path
    assert tis([((2, 3), (0, 0)), ((2, 3), (1, 2))], (2, 3)) == (
        1,
        2,
    )  # an expanded input is skipped
    assert tis([((3,), (1,)), ((2, 3), (1, 2))], (2, 3)) == (1, 2)  # a broadcast input too
    assert tis([((1, 3), (1, 1)), ((), ())], (1, 3)) == (1, 1)  # a 0-dim operand: no fast path
    assert tis([((1, 3, 2), (1, 0, 1)), ((3, 2), (2, 1)), ((1,), (1,))], (1, 3, 2)) == (1, 1, 3)
    assert tis([((2, 3), (3, 1)), ((4, 3), (3, 1))], (2, 3)) is None  # does not broadcast


def test_the_device_hint_is_the_servers_only_while_predicting():
    x = torch.empty(5, 3, device="meta")
    on_cpu = meta_fixes.run_meta(torch.ops.aten.nonzero_static.default, (x,), {"size": 4}, "cpu")
    on_cuda = meta_fixes.run_meta(torch.ops.aten.nonzero_static.default, (x,), {"size": 4}, "cuda")
    assert on_cpu.stride() == (2, 1) and on_cuda.stride() == (1, 4)
    # outside a prediction, torch's own answer for a meta tensor (CUDA) is untouched
    assert torch.nonzero_static(x, size=4).stride() == (1, 4)


# -- end to end: wrong predictions used to read wrong numbers through views -------------------


def test_nonzero_static_read_through_a_view_matches_the_cpu(dev):
    x = torch.tensor([[0.0, 1.0], [2.0, 0.0]])
    expected = torch.nonzero_static(x, size=4)
    got = torch.nonzero_static(x.to(dev), size=4)
    assert got.stride() == expected.stride()
    assert torch.equal(got[:, 1].cpu(), expected[:, 1])  # the example: [1, 0, -1, -1]
    assert torch.equal(got.t().cpu(), expected.t())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_a_pointwise_op_of_an_expanded_and_a_transposed_input_reads_right(dev, dtype):
    a = torch.tensor([1.5], dtype=dtype)
    b = torch.arange(6.0, dtype=dtype).reshape(3, 2).t()
    expected = a.expand(2, 3) * b
    got = a.to(dev).expand(2, 3) * b.to(dev)
    assert got.stride() == expected.stride()
    assert torch.equal(got[:, 1].cpu(), expected[:, 1])
    assert torch.equal(got.t().cpu(), expected.t())


def _same_as_cpu(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert (got.dtype, got.shape, got.stride()) == (
        expected.dtype,
        expected.shape,
        expected.stride(),
    )
    assert torch.equal(got.cpu(), expected)
    assert torch.equal(got.reshape(-1).cpu(), expected.reshape(-1))


SHIFTS = {
    "t << t": lambda a, b: a << b,
    "t >> t": lambda a, b: a >> b,
    "t << 1": lambda a, b: a << 1,
    "t >> 1": lambda a, b: a >> 1,
    "1 << t": lambda a, b: 1 << a,
    "t <<= 1": lambda a, b: a.clone().__ilshift__(1),
    "t >>= t": lambda a, b: a.clone().__irshift__(b),
    "t << cpu 0-dim": lambda a, b: a << torch.tensor(1),
    "out=": lambda a, b: torch.ops.aten.__lshift__.Tensor_out(a, b, out=a.new_empty(0)),
}


@pytest.mark.parametrize("dtypes", [(torch.int64, torch.int64), (torch.uint8, torch.int32),
                                    (torch.bool, torch.int64), (torch.int32, torch.bool),
                                    (torch.int8, torch.int8)],
                         ids=lambda d: f"{d[0]}-{d[1]}".replace("torch.", ""))  # fmt: skip
@pytest.mark.parametrize("op", list(SHIFTS), ids=list(SHIFTS))
def test_shifts_run_as_on_the_cpu(dev, op, dtypes):
    """`t << 1` and its kin failed at the next sync: the server refused the name
    `__lshift__.Scalar`, and the dunders' meta kernels refused a bool operand."""
    f = SHIFTS[op]
    a = torch.tensor([[1, 2, 3], [0, 1, 5]]).to(dtypes[0]).t()
    b = torch.tensor([1, 0]).to(dtypes[1])
    try:
        expected = f(a, b)
    except RuntimeError as e:
        with pytest.raises(RuntimeError, match=re.escape(str(e).split(":")[-1].strip())):
            f(a.to(dev), b.to(dev))
        return
    _same_as_cpu(f(a.to(dev), b.to(dev)), expected)


@pytest.mark.parametrize("exponent", [True, False, 1, 0, 2, 2.0, 0.5])
def test_pow_of_a_bool_tensor_reads_back_as_on_the_cpu(dev, exponent):
    """`torch.pow(bool_tensor, True)` was int64 on the client, bool on the server: `.cpu()`
    raised ProtocolViolation, other reads were wrong."""
    b = torch.tensor([[True, False, True], [False, True, True]]).t()
    _same_as_cpu(torch.pow(b.to(dev), exponent), torch.pow(b, exponent))
    _same_as_cpu(b.to(dev) ** exponent, b**exponent)
    assert (torch.pow(b.to(dev), exponent).long() * 5).sum().item() == (
        (torch.pow(b, exponent).long() * 5).sum().item()
    )
    if isinstance(exponent, bool):
        _same_as_cpu(b.to(dev).clone().pow_(exponent), b.clone().pow_(exponent))
        out_r, out_c = (
            torch.empty(0, dtype=torch.bool, device=dev),
            torch.empty(0, dtype=torch.bool),
        )
        torch.pow(b.to(dev), exponent, out=out_r)
        torch.pow(b, exponent, out=out_c)
        _same_as_cpu(out_r, out_c)


def test_pows_the_cpu_refuses_in_bool_raise_at_the_op(dev):
    b = torch.tensor([True, False])
    for f in [lambda x: torch.pow(x, x), lambda x: True**x, lambda x: x.clone().pow_(x)]:
        with pytest.raises(NotImplementedError):
            f(b)
        with pytest.raises(rgpu.RemoteError, match="not implemented for 'Bool'"):
            f(b.to(dev))
    assert torch.equal(b.to(dev).cpu(), b)  # the session goes on


# -- the checking mode ----------------------------------------------------------------------


def test_the_checking_mode_fails_an_op_whose_output_differs_from_its_prediction(dev, session):
    from rgpu.tensor import next_id
    from rgpu_protocol import Kind, TensorMeta

    x = torch.ones(2, 3, device=dev)
    wrong = TensorMeta(torch.float32, (2, 3), (1, 2), 0)  # column-major: the server makes (3, 1)
    session.post((Kind.RUN, "clone.default", [x], None, [next_id()], [wrong]))
    with pytest.raises(
        rgpu.RemoteError,
        match=r"predicted output 0 as torch.float32 \[2, 3\] strides \[1, 2\] offset 0 but the "
        r"server produced torch.float32 \[2, 3\] strides \[3, 1\] offset 0",
    ):
        torch.rgpu.synchronize()
    assert session.info()["meta_mismatches"] == 1
    # the stride of a size-1 dim addresses no element: no difference
    y = torch.ones(1, 3, device=dev)
    size_one = TensorMeta(torch.float32, (1, 3), (7, 1), 0)
    session.post((Kind.RUN, "clone.default", [y], None, [next_id()], [size_one]))
    torch.rgpu.synchronize()
    assert session.info()["meta_mismatches"] == 1


def test_models_train_in_the_checking_mode_with_every_prediction_right(server):
    """A fresh process with RGPU_CHECK_META=1: every op of an MLP, a CNN (batch norm, pooling,
    channels-last too), a transformer (attention, layer norm) and LSTM/GRU layers, forward and
    backward in float32 and bfloat16, is checked by the server against its prediction."""
    code = """
        import torch, rgpu
        from rgpu.models import SmallCNN, TinyLM, LSTMRegressor, lm_batch, seed_mlp
        rgpu.connect(RGPU_URL)
        torch.manual_seed(0)
        runs = [
            (seed_mlp(), lambda: (torch.randn(16, 16),)),
            (SmallCNN(), lambda: (torch.randn(4, 3, 16, 16),)),
            (SmallCNN(channels_last=True), lambda: (torch.randn(4, 3, 16, 16),)),
            (TinyLM(vocab=65, width=32, heads=4, layers=1, context=16),
             lambda: lm_batch(65, 2, 16, torch.Generator().manual_seed(1))),
            (LSTMRegressor(), lambda: (torch.randn(4, 5, 8),)),
        ]
        for dtype in (torch.float32, torch.bfloat16):
            for model, batch in runs:
                model = model.to("rgpu", dtype)
                args = [a.to("rgpu", dtype) if a.is_floating_point() else a.to("rgpu") for a in batch()]
                out = model(*args)
                loss = out[1] if isinstance(out, tuple) else out.float().square().mean()
                loss.backward()
                torch.rgpu.synchronize()
        print(rgpu.session_info()["meta_mismatches"])
    """.replace("RGPU_URL", repr(server.url))
    env = {**os.environ, "RGPU_CHECK_META": "1"}
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["0"]


LOSSES = {
    "mse": lambda x, t: F.mse_loss(x, t),
    "mse-none": lambda x, t: F.mse_loss(x, t, reduction="none").sum(),
    "smooth_l1": lambda x, t: F.smooth_l1_loss(x, t),
    "huber": lambda x, t: F.huber_loss(x, t),
    "binary_cross_entropy": lambda x, t: F.binary_cross_entropy(x.sigmoid(), t.sigmoid()),
    "logsigmoid": lambda x, t: F.logsigmoid(x).sum(),
}


@pytest.mark.parametrize("loss", LOSSES.values(), ids=LOSSES.keys())
def test_losses_of_a_transposed_input_have_the_cpus_gradient(dev, loss):
    """Their backwards allocate the gradient contiguous (logsigmoid's like its incoming gradient,
    which a `sum` hands on expanded): predicted like the transposed input, the gradient read
    back was permuted (mse off by 0.17, logsigmoid by 0.08)."""
    x, t = torch.randn(4, 5), torch.randn(4, 5)
    xc, xr = x.clone().requires_grad_(), x.to(dev).requires_grad_()
    lc, lr = loss(xc.T, t.T), loss(xr.T, t.to(dev).T)
    lc.backward()
    lr.backward()
    torch.testing.assert_close(lr.cpu(), lc.detach())
    torch.testing.assert_close(xr.grad.cpu(), xc.grad)


MIXED_DTYPE_LOSSES = {  # float32 input, float64 target or weight (made with numpy)
    "huber": lambda x, t: F.huber_loss(x, t, reduction="none"),
    "soft_margin": lambda x, t: F.soft_margin_loss(x, t),
    "soft_margin-none": lambda x, t: F.soft_margin_loss(x, t, reduction="none"),
    "binary_cross_entropy-weight": lambda x, t: F.binary_cross_entropy(
        x.sigmoid(), t.float().sigmoid(), weight=t.abs()
    ),
    "binary_cross_entropy-weight-none": lambda x, t: F.binary_cross_entropy(
        x.sigmoid(), t.float().sigmoid(), weight=t.abs(), reduction="none"
    ),
}


@pytest.mark.parametrize("loss", MIXED_DTYPE_LOSSES.values(), ids=MIXED_DTYPE_LOSSES.keys())
def test_losses_with_a_float64_target_or_weight_keep_the_inputs_dtype(dev, loss):
    """The CPU and CUDA kernels compute these in the input's dtype; their meta kernels promote.
    Predicted float64, the server's float32 loss was refused at the download ("download of 8
    bytes returned 4"), where the CPU gives a float32 loss and gradient."""
    x, t = torch.randn(4, 5), torch.randn(4, 5, dtype=torch.float64)
    xc, xr = x.clone().requires_grad_(), x.to(dev).requires_grad_()
    lc, lr = loss(xc, t), loss(xr, t.to(dev))
    assert lr.dtype == lc.dtype == torch.float32
    torch.testing.assert_close(lr.cpu(), lc.detach(), rtol=0, atol=0)
    if loss is not MIXED_DTYPE_LOSSES["huber"]:  # its backward refuses the float64 target
        lc.sum().backward()
        lr.sum().backward()
        torch.testing.assert_close(xr.grad.cpu(), xc.grad, rtol=0, atol=0)
    mean, std = torch.zeros(3), torch.full((3,), 1e-6, dtype=torch.float64)
    assert torch.normal(mean.to(dev), std.to(dev)).cpu().dtype == torch.normal(mean, std).dtype


def test_samplers_with_transposed_parameters_keep_each_elements_parameters(dev):
    """normal, poisson and gamma allocate their result contiguous: predicted like the
    transposed mean, `torch.normal(mean.T, std.T)[0]` took its values from the wrong means."""
    mean, std = torch.arange(12.0).reshape(3, 4), torch.full((3, 4), 1e-6)
    r = torch.normal(mean.to(dev).T, std.to(dev).T)
    assert r.stride() == torch.normal(mean.T, std.T).stride()
    torch.testing.assert_close(r[0].cpu(), mean.T[0], atol=1e-3, rtol=0)
    torch.testing.assert_close((torch.normal(0.0, std.to(dev).T) + mean.to(dev).T)[1].cpu(),
                               mean.T[1], atol=1e-3, rtol=0)  # fmt: skip
    for sample in (torch.poisson, torch._standard_gamma):
        assert sample((mean + 1).to(dev).T).stride() == sample((mean + 1).T).stride()


@pytest.mark.parametrize("inference", [False, True])
def test_one_hot_of_a_transposed_index_is_laid_out_as_on_the_cpu(dev, inference):
    """PyTorch's one_hot takes a functional path for subclass tensors whose output follows the
    index's layout: strides (5, 10, 1) where the CPU's are (20, 5, 1), so `.view(-1, 5)` raised
    and `as_strided` reads differed."""
    idx = torch.tensor([[0, 3, 1, 4], [2, 2, 0, 1]])
    index = idx.T.contiguous().T
    with torch.inference_mode(inference):
        expected = torch.nn.functional.one_hot(index, 5)
        got = torch.nn.functional.one_hot(index.to(dev), 5)
        inferred = torch.nn.functional.one_hot(index.to(dev))
    assert got.stride() == expected.stride() and torch.equal(got.cpu(), expected)
    assert torch.equal(got.view(-1, 5).cpu(), expected.view(-1, 5))
    assert torch.equal(inferred.cpu(), expected)
    with pytest.raises(RuntimeError, match="LongTensor"):
        torch.nn.functional.one_hot(index.to(dev).int(), 5)


def test_view_copy_of_a_tensor_that_cannot_be_viewed_copies_as_on_the_cpu(dev):
    """The meta kernel of view_copy refuses a size the input cannot be viewed as; the CPU's (and
    CUDA's) copies through reshape."""
    x = torch.arange(24.0).reshape(2, 3, 4)
    for make in (lambda t: t.transpose(0, 2), lambda t: t[:, ::2], lambda t: t):
        for size in ((-1,), (4, -1)):
            expected = torch.view_copy(make(x), size)
            got = torch.view_copy(make(x.to(dev)), size)
            assert got.stride() == expected.stride() and torch.equal(got.cpu(), expected)
