"""A CPU tensor beside rgpu tensors: refused where CUDA refuses it, taken where CUDA takes it.

Before, `F.linear`, `@`, `F.conv2d`, `F.embedding`, `index_select` and `gather` took a CPU tensor
of any size beside rgpu tensors (sent inline, uploaded again on every call: a layer left on the
CPU ran slowly without a word), and a backward through such a CPU weight stopped at an internal
assert of PyTorch's autograd engine.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import rgpu

SAME_DEVICE = r"Expected all tensors to be on the same device.*rgpu:0 and cpu.*\.to\('rgpu:0'\)"


def _refused(dev):
    x = torch.randn(4, 8, device=dev)
    ids = torch.tensor([[1, 2]], device=dev)
    weight, idx = torch.randn(8, 8), torch.tensor([0, 2])
    return {
        "matmul": lambda: x @ weight,
        "mm": lambda: torch.mm(x, weight),
        "linear": lambda: F.linear(x, weight),
        "linear-bias": lambda: F.linear(x, weight.to(dev), torch.zeros(8)),
        "embedding-cpu-weight": lambda: F.embedding(ids, weight),
        "embedding-cpu-ids": lambda: F.embedding(torch.tensor([[1, 2]]), weight.to(dev)),
        "index_select": lambda: x.index_select(0, idx),
        "gather": lambda: x.gather(1, torch.zeros(4, 1, dtype=torch.long)),
        "masked_fill": lambda: x.masked_fill(torch.zeros(4, 8, dtype=torch.bool), 1.0),
        "where": lambda: torch.where(torch.zeros(4, 8, dtype=torch.bool), x, x),
        "conv2d": lambda: F.conv2d(x.view(1, 1, 4, 8), torch.randn(1, 1, 3, 3)),
        "add": lambda: x + torch.randn(4, 8),
        "nll_loss-weight": lambda: F.nll_loss(
            x[:, :3].log_softmax(1), torch.tensor([0, 1, 2, 0], device=dev), weight=torch.ones(3)
        ),
        "one-element-1d": lambda: x * torch.tensor([2.0]),
    }


REFUSED = list(_refused("cpu"))


@pytest.mark.parametrize("case", REFUSED)
def test_a_cpu_tensor_beside_rgpu_tensors_is_refused_as_cuda_refuses_it(dev, counted, case):
    with pytest.raises(RuntimeError, match=SAME_DEVICE):
        _refused(dev)[case]()
    assert counted()["waits"] == 0  # refused here, at the call
    assert torch.ones(2, device=dev).add(1).cpu().tolist() == [2.0, 2.0]  # the session goes on


def test_a_layer_left_on_the_cpu_is_named_and_nothing_reaches_autograd(dev):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    ref = copy.deepcopy(model)
    model[0].to(dev)  # the second layer forgotten
    x = torch.randn(3, 8)
    with pytest.raises(RuntimeError, match=SAME_DEVICE + r".*module: \.to\('rgpu'\)"):
        model(x.to(dev)).sum().backward()
    # moved, the same model trains, with the CPU's gradients
    model.to(dev)
    model(x.to(dev)).sum().backward()
    ref(x).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad.cpu(), q.grad)


def test_what_cuda_takes_from_the_cpu_works_and_equals_the_cpu(dev):
    base = torch.arange(32.0).reshape(4, 8)
    x = base.to(dev)
    idx = torch.tensor([0, 2])
    mask = torch.tensor([True, False, True, False])
    assert torch.equal(x[idx].cpu(), base[idx])  # CPU indices
    assert torch.equal(x[mask].cpu(), base[mask])
    assert torch.equal((x * torch.tensor(2.0)).cpu(), base * 2)  # a 0-dim CPU tensor is a number
    kept = torch.where(x > 3, x, torch.tensor(0.0))
    assert torch.equal(kept.cpu(), torch.where(base > 3, base, torch.tensor(0.0)))
    y, ref = x.clone(), base.clone()
    y[idx] = torch.ones(2, 8)
    ref[idx] = torch.ones(2, 8)
    assert torch.equal(y.cpu(), ref)
    y.index_put_((idx,), torch.full((2, 8), 5.0))
    ref.index_put_((idx,), torch.full((2, 8), 5.0))
    assert torch.equal(y.cpu(), ref)
    y.copy_(torch.zeros(4, 8))
    assert torch.equal(y.cpu(), torch.zeros(4, 8))
    made = torch.empty_like(base, device=dev).fill_(3.0)  # a factory from a CPU tensor
    assert made.device.type == "rgpu" and torch.equal(made.cpu(), torch.full((4, 8), 3.0))
    assert rgpu.current.get() is not None


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_ctc_loss_takes_its_lengths_on_the_cpu_as_cuda_does(dev, reduction):
    """cuDNN's CTC wants the lengths on the CPU, so CTC code keeps them there; the mean divides
    the loss by them, which met a CPU tensor beside an rgpu one."""
    torch.manual_seed(0)
    log_probs = torch.randn(12, 2, 5).log_softmax(2)
    targets = torch.randint(1, 5, (2, 4))
    lengths = torch.tensor([12, 10]), torch.tensor([4, 3])
    ref = log_probs.clone().requires_grad_()
    expected = F.ctc_loss(ref, targets, *lengths, reduction=reduction)
    expected.sum().backward()
    remote = log_probs.to(dev).requires_grad_()
    loss = F.ctc_loss(remote, targets.to(dev), *lengths, reduction=reduction)
    loss.sum().backward()
    torch.testing.assert_close(loss.cpu(), expected)
    torch.testing.assert_close(remote.grad.cpu(), ref.grad)
    with torch.inference_mode():  # autograd's kernel skipped
        torch.testing.assert_close(
            F.ctc_loss(remote, targets.to(dev), *lengths, reduction=reduction).cpu(),
            expected.detach(),
        )
