"""Lazy modules (`nn.LazyLinear`, `LazyConv2d`, `LazyBatchNorm2d`) on rgpu before their first
forward: moved with `.to("rgpu")` or made with `device="rgpu"`. Each raised before (a clear error
for the move, PyTorch's "Creating a new Tensor subclass UninitializedParameter ..." for the
constructor), where CUDA takes them; now they train as the CPU does, initialized as the CPU
initializes them."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 3, 8, 8, generator=g) for _ in range(3)]


def _model(**kw: object) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.LazyConv2d(5, 3, **kw), nn.LazyBatchNorm2d(**kw), nn.ReLU(), nn.Flatten(),
        nn.LazyLinear(7, **kw), nn.Tanh(), nn.LazyLinear(2, **kw),
    )  # fmt: skip


def _train(model: nn.Module, device: str) -> tuple[list[float], dict]:
    batches = _batches()
    model(batches[0].to(device))  # the dry run PyTorch asks for before making the optimizer
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x in batches:
        loss = model(x.to(device)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.cpu() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("how", ["moved", "made-there"])
def test_a_lazy_model_trains_on_rgpu_as_on_the_cpu(dev, how):
    want_losses, want_state = _train(_model(), "cpu")
    model = _model().to(dev) if how == "moved" else _model(device=dev)
    losses, state = _train(model, dev)
    assert all(p.device.type == "rgpu" for p in model.parameters())
    assert all(b.device.type == "rgpu" for b in model.buffers())
    assert not any(isinstance(p, nn.parameter.UninitializedParameter) for p in model.parameters())
    assert losses == want_losses
    assert state.keys() == want_state.keys()
    for k in state:
        assert torch.equal(state[k], want_state[k]), k


def test_a_lazy_module_moved_with_a_dtype_takes_it(dev):
    cpu = nn.LazyLinear(3).to(torch.float64)
    remote = nn.LazyLinear(3).to(dev, torch.float64)
    x = torch.randn(2, 5, dtype=torch.float64)
    torch.manual_seed(0)  # the first forward initializes the parameters
    want = cpu(x)
    torch.manual_seed(0)
    got = remote(x.to(dev))
    assert remote.weight.dtype == torch.float64 and remote.weight.device.type == "rgpu"
    assert torch.equal(got.detach().cpu(), want.detach())


def test_a_copy_of_a_lazy_module_moved_to_rgpu_lands_there_too(dev):
    moved = nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.LazyLinear(2)).to(dev)
    twin = copy.deepcopy(moved)  # PyTorch copies no lazy buffer before the forward
    x = torch.randn(3, 5)
    torch.manual_seed(0)
    want = nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.LazyLinear(2))(x)
    torch.manual_seed(0)
    got = twin(x.to(dev))
    assert all(p.device.type == "rgpu" for p in twin.parameters())
    assert torch.equal(got.detach().cpu(), want.detach())


def test_a_state_dict_loads_into_a_lazy_module_moved_to_rgpu(dev):
    torch.manual_seed(3)
    trained = nn.Linear(5, 3)
    lazy = nn.LazyLinear(3).to(dev)
    lazy.load_state_dict(trained.state_dict())
    assert lazy.weight.device.type == "rgpu" and lazy.bias.device.type == "rgpu"
    x = torch.randn(2, 5)
    assert torch.equal(lazy(x.to(dev)).detach().cpu(), trained(x).detach())


def test_lazy_modules_elsewhere_are_left_as_they_were():
    torch.manual_seed(0)
    m = nn.LazyLinear(3).to(torch.float64)
    assert isinstance(m.weight, nn.parameter.UninitializedParameter)
    assert m.weight.dtype == torch.float64
    m(torch.randn(2, 4, dtype=torch.float64))
    assert m.weight.shape == (3, 4) and m.weight.device.type == "cpu"
    with pytest.raises(ValueError, match="uninitialized parameter"):
        torch.add(nn.LazyLinear(3).weight, 1)  # PyTorch's own refusal stands
