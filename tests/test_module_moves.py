"""Converting a module (`.to("rgpu")`, `.half()`, ...) while an autograd graph still holds its
parameters: a forward's output kept in a variable, a compiled model's graph. CUDA converts it;
rgpu did not ("Couldn't swap LayerNorm.weight", the model left half moved)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

STALE = "graph whose parameters were converted since"


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.GELU(), nn.Linear(6, 2))


def test_a_cpu_model_moves_while_its_forward_output_is_kept(dev):
    model = small_model()
    local = copy.deepcopy(model)
    x = torch.randn(5, 4)
    kept = model(x)  # a notebook cell that tried the model on the CPU first
    params = list(model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # made before the move, as users do
    model.to(dev)
    assert [p is q for p, q in zip(params, model.parameters())] == [True] * len(params)
    assert all(p.device.type == "rgpu" for p in model.parameters())

    for m, o, d in ((model, opt, dev), (local, torch.optim.SGD(local.parameters(), lr=0.1), "cpu")):
        m(x.to(d)).pow(2).sum().backward()
        o.step()
    for r, c in zip(model.parameters(), local.parameters()):
        torch.testing.assert_close(r.detach().cpu(), c.detach(), rtol=1e-6, atol=1e-6)

    # the kept graph's gradients would land in the old CPU tensors: refused, as CUDA refuses it
    with pytest.raises(RuntimeError, match=STALE):
        kept.sum().backward()
    assert torch.equal(model[0].weight.cpu(), model[0].weight.cpu())  # the session goes on
    assert model(x.to(dev)).shape == (5, 2)


@pytest.mark.parametrize("convert", ["half", "bfloat16", "double"])
def test_an_rgpu_model_converts_while_its_graph_is_kept(dev, convert):
    model = small_model().to(dev)
    local = small_model()
    x = torch.randn(3, 4)
    kept = model(x.to(dev))
    getattr(model, convert)()
    getattr(local, convert)()
    dtype = local[0].weight.dtype
    for r, c in zip(model.parameters(), local.parameters()):
        assert r.dtype == dtype
        assert torch.equal(r.detach().cpu(), c.detach())
    torch.testing.assert_close(model(x.to(dev, dtype)).cpu(), local(x.to(dtype)), rtol=0, atol=0)
    # the CPU refuses this backward too ("expected scalar type Float but found Half"); on rgpu it
    # must be an error, not an aborted process
    with pytest.raises(RuntimeError, match=STALE):
        kept.sum().backward()
    model(x.to(dev, dtype)).float().sum().backward()
    assert model[0].weight.grad.dtype == dtype


def test_gradients_move_with_their_parameters(dev):
    model = small_model()
    x = torch.randn(3, 4)
    model(x).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    kept = model(x)  # noqa: F841  (holds the parameters)
    model.to(dev)
    for p, g in zip(model.parameters(), grads):
        assert p.grad.device.type == "rgpu"
        assert torch.equal(p.grad.cpu(), g)
    model.to("cpu")
    for p, g in zip(model.parameters(), grads):
        assert p.grad.device.type == "cpu"
        assert torch.equal(p.grad, g)


def test_a_model_compiled_on_the_cpu_moves_to_rgpu(dev):
    model = small_model()
    compiled = torch.compile(model)
    x = torch.randn(3, 4)
    expected = compiled(x)
    model.to(dev)  # the CPU graph holds the parameters
    out = compiled(x.to(dev))
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-6, atol=1e-6)
    out.sum().backward()
    assert model[0].weight.grad.device.type == "rgpu"


def test_swap_tensors_elsewhere_keeps_pytorchs_checks(dev):
    a = torch.ones(3, device=dev, requires_grad=True)
    held = a * a  # noqa: F841  (saves `a`)
    with pytest.raises(RuntimeError, match="Expected use_count of t1"):
        torch.utils.swap_tensors(a, torch.zeros(3, device=dev))


@pytest.mark.parametrize("lazy", [lambda: nn.LazyLinear(3), lambda: nn.LazyBatchNorm1d()])
def test_a_lazy_module_moves_once_a_forward_has_shaped_it(dev, lazy):
    """(Before its first forward it moves too: tests/test_lazy_modules.py.)"""
    torch.manual_seed(3)
    model = lazy()
    x = torch.randn(4, 5)
    model(x)
    local = copy.deepcopy(model)
    model.to(dev)
    torch.testing.assert_close(model(x.to(dev)).cpu(), local(x), rtol=0, atol=0)
