"""`torch.set_default_dtype` on the client: the server keeps float32 as its own default, so ops
whose output dtype comes from the default are sent naming the dtype (rgpu/default_dtype.py).

Every result is compared with local CPU torch under the same default: dtype, shape, strides and
exact values (random ones: dtype, shape and determinism).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import rgpu

DEFAULTS = [torch.float64, torch.float16, torch.bfloat16]


@pytest.fixture
def default64(dev):
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield dev
    finally:
        torch.set_default_dtype(saved)


@pytest.fixture(params=DEFAULTS, ids=str)
def default(request, dev):
    saved = torch.get_default_dtype()
    torch.set_default_dtype(request.param)
    try:
        yield request.param
    finally:
        torch.set_default_dtype(saved)


def same(remote, expected) -> None:
    assert remote.dtype == expected.dtype, (remote.dtype, expected.dtype)
    assert remote.shape == expected.shape
    assert remote.stride() == expected.stride(), (remote.stride(), expected.stride())
    got = remote.cpu()
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if got.dtype == torch.complex32:  # no kernel compares complex32: widen both, exactly
        got, expected = got.to(torch.complex64), expected.to(torch.complex64)
    assert torch.equal(got, expected) or (
        got.is_floating_point() and torch.equal(got.isnan(), expected.isnan())
        and torch.equal(got.nan_to_num(), expected.nan_to_num())
    ), (got, expected)  # fmt: skip


FACTORIES = {
    "zeros": lambda d: torch.zeros(2, 3, device=d),
    "ones": lambda d: torch.ones(4, device=d),
    "full": lambda d: torch.full((3,), 0.1, device=d),
    "full_int_value": lambda d: torch.full((3,), 7, device=d),
    "full_complex": lambda d: torch.full((2,), 0.1 + 0.2j, device=d),
    "arange_float": lambda d: torch.arange(0.0, 3.0, device=d),
    "arange_step": lambda d: torch.arange(0.0, 1.0, 0.1, device=d),
    "arange_int": lambda d: torch.arange(5, device=d),
    "linspace": lambda d: torch.linspace(0, 1, 7, device=d),
    "logspace": lambda d: torch.logspace(0, 2, 5, device=d),
    "eye": lambda d: torch.eye(3, device=d),
    "eye_rect": lambda d: torch.eye(2, 3, device=d),
    "scalar_tensor": lambda d: torch.scalar_tensor(0.1, device=d),
    "tensor": lambda d: torch.tensor([0.1, 1 / 3], device=d),
    "hann_window": lambda d: torch.hann_window(5, device=d),
    "explicit_float32": lambda d: torch.ones(3, dtype=torch.float32, device=d) / 3,
}


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_factories_follow_the_default_dtype(default, name):
    f = FACTORIES[name]
    same(f("rgpu"), f("cpu"))


@pytest.mark.parametrize(
    "make", ["empty", "empty_strided", "rand", "randn", "randint", "randperm", "normal"]
)
def test_uninitialised_and_random_factories(default, make):
    f = {
        "empty": lambda d: torch.empty(2, 3, device=d),
        "empty_strided": lambda d: torch.empty_strided((2, 3), (1, 2), device=d),
        "rand": lambda d: torch.rand(2, 3, device=d),
        "randn": lambda d: torch.randn(2, 3, device=d),
        "randint": lambda d: torch.randint(0, 9, (2, 3), device=d),
        "randperm": lambda d: torch.randperm(6, device=d),
        "normal": lambda d: torch.normal(0.0, 1.0, (2, 3), device=d),
    }[make]
    cpu = f("cpu")
    torch.manual_seed(3)
    a = f("rgpu")
    torch.manual_seed(3)
    b = f("rgpu")
    assert (a.dtype, a.shape, a.stride()) == (cpu.dtype, cpu.shape, cpu.stride())
    a_cpu = a.cpu()  # the server made as many bytes as the client expects
    assert a_cpu.dtype == cpu.dtype and a_cpu.shape == cpu.shape
    if make != "empty" and make != "empty_strided":
        assert torch.equal(a_cpu, b.cpu())


INT_OPS = {
    "mul_float": lambda i, m: i * 0.5,
    "true_div_scalar": lambda i, m: i / 2,
    "true_div_tensor": lambda i, m: i / (i + 1),
    "rdiv": lambda i, m: 1 / (i + 1),
    "sqrt": lambda i, m: torch.sqrt(i),
    "exp": lambda i, m: torch.exp(i),
    "sigmoid": lambda i, m: torch.sigmoid(i),
    "pow_float": lambda i, m: i**0.5,
    "atan2": lambda i, m: torch.atan2(i, i + 1),
    "where_scalar": lambda i, m: torch.where(m, i, 0.5),
    "where_two_scalars": lambda i, m: torch.where(m, 0.25, 0.5),
    "bool_mul": lambda i, m: m * 0.5,
    "bool_sqrt": lambda i, m: torch.sqrt(m),
    "mul_complex": lambda i, m: i * (1 + 2j),
    "fft": lambda i, m: torch.fft.fft(i),
    "transposed": lambda i, m: i.view(2, 3).t() / 3,
    "sliced": lambda i, m: i[::2] / 3,
    "expanded": lambda i, m: i[:3].expand(2, 3) * 0.1,
    "mean_of_float": lambda i, m: (i / 3).mean(),
    "linspace_tensors": lambda i, m: torch.linspace(i[1], i[4], 5),
    "linspace_float32_tensors": lambda i, m: torch.linspace(i[1].float(), i[4].float(), 5),
    "ldexp": lambda i, m: torch.ldexp(i % 7, i % 4),
    "mvlgamma": lambda i, m: torch.mvlgamma(i % 7 + 3, 2),
    "div_out": lambda i, m: torch.div(i, 3, out=torch.empty(6, device=i.device)),
    "div_out_float32": lambda i, m: torch.div(
        i, 3, out=torch.empty(6, dtype=torch.float32, device=i.device)
    ),
    "mul_out_resized": lambda i, m: torch.mul(i, 0.1, out=torch.empty(0, device=i.device)),
    "int_stays_int": lambda i, m: i * 2 + 1,
    "add_out_int_into_float": lambda i, m: torch.add(
        i, i, out=torch.empty(6, dtype=torch.float64, device=i.device)
    ),
    "floor_divide": lambda i, m: i // 2,
}


@pytest.mark.parametrize("name", sorted(INT_OPS))
def test_integer_inputs_promote_to_the_default_dtype(default, name):
    f = INT_OPS[name]

    def run(d):
        i = torch.arange(1, 7, device=d) * 16777217
        return f(i, i % 3 == 0)

    try:
        expected = run("cpu")
    except RuntimeError as e:  # fft of float16, 1e8 in float16: refused alike
        with pytest.raises(RuntimeError, match=str(e)[:20]):
            run("rgpu").cpu()
        return
    same(run("rgpu"), expected)


def test_a_plan_from_float32_is_not_reused_under_float64(dev):
    saved = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float32)
        i = torch.arange(3, device=dev)
        assert (i / 3).dtype == torch.float32 and torch.zeros(2, device=dev).dtype == torch.float32
        torch.set_default_dtype(torch.float64)
        same(i / 3, torch.arange(3) / 3)
        same(torch.zeros(2, device=dev), torch.zeros(2))
        same(torch.full((2,), 0.1, device=dev), torch.full((2,), 0.1))
        torch.set_default_dtype(torch.float32)
        same(i / 3, torch.arange(3) / 3)
        same(torch.full((2,), 0.1, device=dev), torch.full((2,), 0.1))
    finally:
        torch.set_default_dtype(saved)


def test_the_silent_cases_give_the_cpu_values(default64):
    d = default64
    assert (torch.full((1,), 1 + 1e-10, device=d) > 1).cpu().tolist() == [True]
    assert (torch.full((1,), 1e-300, device=d) * 1e300).float().cpu().tolist() == [1.0]
    third = torch.arange(0.0, 3.0, device=d) / 3 * 3
    same(
        third == torch.arange(0.0, 3.0, device=d),
        torch.arange(0.0, 3.0) / 3 * 3 == torch.arange(0.0, 3.0),
    )
    assert (torch.ones(3, device=d) * 16777217).long().cpu().tolist() == [16777217] * 3
    assert (torch.zeros(2, device=d) + 0.1).sum().item() == (torch.zeros(2) + 0.1).sum().item()


def test_an_op_rgpu_cannot_reproduce_raises(default64):
    import rgpu.default_dtype as dd

    class Plan:  # an op that depends on the default and takes no dtype and no tensor
        view = False
        spec = (0, (torch.float64, (2,), (1,), 0, 16, 0))

    action = dd._classify(torch.ops.aten.sin.default, (), {}, Plan(), None, torch.float64)
    assert action[0] == dd._REFUSE
    assert "default dtype" in action[1] and "torch.float64" in action[1]
    assert "dtype=" in action[1] and "aten.sin.default" in action[1]


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def test_linear_made_on_rgpu_is_float64_on_both_sides(default64):
    layer = nn.Linear(3, 2, device=default64)
    assert layer.weight.dtype == torch.float64 and layer.bias.dtype == torch.float64
    w = layer.weight.detach().cpu()
    assert w.dtype == torch.float64 and w.shape == (2, 3)
    x = torch.arange(6, device=default64).view(2, 3) / 7
    same(layer(x).detach(), torch.nn.functional.linear(x.cpu(), w, layer.bias.detach().cpu()))


def test_mlp_forward_and_backward_match_the_cpu(default64):
    cpu = _mlp()
    remote = _mlp().to(default64)
    assert all(p.dtype == torch.float64 for p in remote.parameters())
    x = torch.arange(20).view(4, 5) / 9  # int / int: float64 under this default
    target = torch.linspace(-1, 1, 12).view(4, 3)
    loss_cpu = nn.functional.mse_loss(cpu(x), target)
    loss_cpu.backward()
    loss = nn.functional.mse_loss(remote(x.to(default64)), target.to(default64))
    loss.backward()
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss.cpu(), loss_cpu.detach(), rtol=1e-12, atol=1e-14)
    for p, q in zip(remote.parameters(), cpu.parameters(), strict=True):
        assert p.grad.dtype == torch.float64
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-12, atol=1e-14)
    # a model built on rgpu under float64 trains in float64 too
    made = nn.Sequential(nn.Linear(5, 8, device=default64), nn.Tanh())
    out = made(x.to(default64)).sum()
    out.backward()
    assert out.dtype == torch.float64 and made[0].weight.grad.cpu().dtype == torch.float64


def test_float32_default_sends_ops_unchanged(dev):
    assert torch.get_default_dtype() is torch.float32
    i = torch.arange(3, device=dev)
    before = rgpu.stats()["messages"]
    y = i / 3
    assert rgpu.stats()["messages"] - before == 1  # one RUN, no cast
    same(y, torch.arange(3) / 3)
