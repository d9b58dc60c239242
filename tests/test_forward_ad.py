"""Forward-mode AD on rgpu (`torch.func.jvp`, `jacfwd`, `hessian`, `torch.autograd.forward_ad`):
tangents equal the CPU's. Before, `linear`, `matmul` and the softmaxes went to the server whole
and lost their tangents with no error (`jvp` of `A @ x` was off by 2.0), a Python scalar operand
raised (PyTorch's zero-tangent kernels copy to the meta device), and `quantile` raised inside
PyTorch's meta kernel of `lerp_`.
"""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F

pytestmark = pytest.mark.usefixtures("dev")

DT = torch.float64


def _same(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.device.type == "rgpu"
        torch.testing.assert_close(g.cpu(), w, rtol=1e-12, atol=1e-12)


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 8, dtype=DT),
        torch.nn.GELU(),
        torch.nn.LayerNorm(8, dtype=DT),
        torch.nn.Linear(8, 5, dtype=DT),
        torch.nn.Softmax(-1),
    )


def _both(fn, *inputs: torch.Tensor):
    """fn on CPU inputs, and on the same inputs moved to rgpu (fn gets the device too)."""
    want = fn(torch.device("cpu"), *inputs)
    got = fn(torch.device("rgpu"), *(x.to("rgpu") for x in inputs))
    return got, want


def test_jvp_of_matmul_linear_and_softmaxes():
    torch.manual_seed(1)
    a, x, t = torch.randn(4, 4, dtype=DT), torch.randn(4, dtype=DT), torch.randn(4, dtype=DT)
    fns = {
        "matmul": lambda d, x: a.to(d) @ x,
        "linear": lambda d, x: F.linear(x, a.to(d)),
        "softmax": lambda d, x: torch.softmax(x, 0),
        "log_softmax": lambda d, x: torch.log_softmax(x, 0),
    }
    for name, fn in fns.items():

        def func_jvp(d, x, t, fn=fn):
            return torch.func.jvp(lambda y: fn(d, y), (x,), (t,))

        def dual(d, x, t, fn=fn, name=name):  # the same through forward_ad's dual tensors
            with fwAD.dual_level():
                p, tangent = fwAD.unpack_dual(fn(d, fwAD.make_dual(x, t)))
                assert tangent is not None, f"{name} lost its tangent"
                return p, tangent

        _same(*_both(func_jvp, x, t))
        _same(*_both(dual, x, t))


def test_jacfwd_and_hessian_of_a_model():
    model = _model()
    x = torch.randn(3, 6, dtype=DT)
    remote = _model().to("rgpu")

    def jac(d, x):
        m = model if d.type == "cpu" else remote
        return (torch.func.jacfwd(m)(x),)

    got, want = _both(jac, x)
    _same(got, want)

    def hess(d, x):
        m = model if d.type == "cpu" else remote
        return (torch.func.hessian(lambda y: m(y).pow(2).sum())(x[0]),)

    got, want = _both(hess, x)
    _same(got, want)


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: x * 2,
        lambda x: x + 1,
        lambda x: 3.5 - x,
        lambda x: x * torch.tensor(2.0, dtype=DT),
        lambda x: x.clamp(min=0.1) / 4,
    ],
    ids=["mul-scalar", "add-scalar", "rsub-scalar", "mul-0dim-cpu", "clamp-div"],
)
def test_jvp_with_a_scalar_operand(fn):
    torch.manual_seed(2)
    x, t = torch.randn(5, dtype=DT), torch.randn(5, dtype=DT)
    got, want = _both(lambda d, x, t: torch.func.jvp(fn, (x,), (t,)), x, t)
    _same(got, want)


def test_to_meta_gives_the_layout_without_the_data():
    cpu = torch.randn(4, 6)
    for view in (lambda x: x, lambda x: x.t(), lambda x: x.t()[1:], lambda x: x[:, ::2]):
        for kwargs in ({}, {"dtype": torch.float16}, {"memory_format": torch.contiguous_format}):
            m, want = view(cpu.to("rgpu")).to("meta", **kwargs), view(cpu).to("meta", **kwargs)
            assert m.device.type == "meta" and type(m) is torch.Tensor
            assert (m.shape, m.stride(), m.dtype) == (want.shape, want.stride(), want.dtype)


def test_quantile_under_forward_ad():
    torch.manual_seed(3)
    x, t = torch.randn(7, dtype=DT), torch.randn(7, dtype=DT)
    q = torch.tensor([0.1, 0.5, 0.9], dtype=DT)

    def run(d, x, t, q):
        return torch.func.jvp(lambda y: torch.quantile(y, q), (x,), (t,))

    got, want = _both(run, x, t, q)
    _same(got, want)


@pytest.mark.parametrize("op", ["lerp_", "addcmul_", "addcdiv_"])
def test_in_place_refusals_match_the_cpu(op):
    """These in-place ops' meta kernels are rgpu's own (see meta_fixes._IN_PLACE_OF)."""
    for self_, other in [
        (torch.zeros(3), torch.ones(2, 3)),
        (torch.zeros(3, dtype=torch.long), None),
    ]:
        if other is None:
            if op == "lerp_":
                continue  # lerp takes floating tensors only, and says so on both devices
            other = torch.ones(3)
        args = (other, 0.5) if op == "lerp_" else (other, other)
        with pytest.raises(RuntimeError) as cpu:
            getattr(self_, op)(*args)
        remote = self_.to("rgpu")
        with pytest.raises(RuntimeError) as rgpu_error:
            getattr(remote, op)(*(a.to("rgpu") if isinstance(a, torch.Tensor) else a for a in args))
        assert str(rgpu_error.value) == str(cpu.value)
        torch.testing.assert_close(remote.cpu(), self_)  # nothing was written
    good = torch.randn(3, 4)
    a, b = torch.randn(3, 4), torch.rand(3, 4) + 0.5
    want = getattr(good.clone(), op)(a, b)
    remote = good.to("rgpu")
    out = getattr(remote, op)(a.to("rgpu"), b.to("rgpu"))
    assert out is remote
    torch.testing.assert_close(remote.cpu(), want, rtol=0, atol=0)
