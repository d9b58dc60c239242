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


LIKE = {
    "empty_like": lambda x, d: torch.empty_like(x, device=d),
    "zeros_like": lambda x, d: torch.zeros_like(x, device=d),
    "ones_like": lambda x, d: torch.ones_like(x, device=d, dtype=torch.float64),
    "full_like": lambda x, d: torch.full_like(x, 7, device=d),
    "rand_like": lambda x, d: torch.rand_like(x, device=d),
    "randn_like": lambda x, d: torch.randn_like(x, device=d),
    "randint_like": lambda x, d: torch.randint_like(x, 3, 9, device=d),
    "new_empty": lambda x, d: x.new_empty((2, 5), device=d),
    "new_zeros": lambda x, d: x.new_zeros(4, device=d),
    "new_ones": lambda x, d: x.new_ones((1, 2), device=d),
    "new_full": lambda x, d: x.new_full((3,), -1.5, device=d),
    "new_empty_strided": lambda x, d: x.new_empty_strided((2, 2), (1, 2), device=d),
}


@pytest.mark.parametrize("name", sorted(LIKE))
def test_like_and_new_factories_make_their_tensor_on_the_device_named(dev, name):
    """`torch.zeros_like(x, device="cpu")` of an rgpu `x` came back on rgpu (made by the server
    on its own CPU, under a wrapper that said rgpu)."""
    make = LIKE[name]
    local = torch.arange(12.0).reshape(4, 3).t()  # a layout the like factories keep
    remote = local.to(dev)
    for x, target in ((remote, "cpu"), (local, dev), (remote, dev)):
        torch.manual_seed(4)
        out = make(x, target)
        torch.manual_seed(4)
        expected = make(local, "cpu")
        assert out.device.type == torch.device(target).type
        assert (out.shape, out.stride(), out.dtype) == (
            expected.shape,
            expected.stride(),
            expected.dtype,
        )
        if name not in ("empty_like", "new_empty", "new_empty_strided"):
            # random on the CPU: the CPU generator, as on CUDA; on rgpu the CPU server's, seeded
            # alike by torch.manual_seed
            assert torch.equal(out.cpu(), expected)


def test_torch_tensor_of_rgpu_scalars_reads_them(dev):
    """`torch.tensor([loss_a, loss_b])` reads each element with Python dispatch excluded: it
    reached rgpu's backend kernel, which had none ("Could not run 'aten::_local_scalar_dense'")."""
    x = torch.arange(6.0, device=dev).view(2, 3)
    losses = [x[i].sum() for i in range(2)]
    assert torch.tensor(losses).tolist() == [3.0, 12.0]
    assert torch.tensor([[x[0, 1], 2.0], [3, x[1, 1]]], device=dev).cpu().tolist() == [
        [1.0, 2.0],
        [3.0, 4.0],
    ]
    assert torch.as_tensor([x[1, 2]], dtype=torch.float64).tolist() == [5.0]
