"""Ops whose output shape depends on the data: one wait each, correct shapes, then streaming."""

from __future__ import annotations

import pytest
import torch

import rgpu

CPU = torch.tensor([[0.5, -1.0, 2.0, 0.0], [3.0, 0.0, -2.5, 1.0], [0.0, 4.0, 1.0, -1.0]])


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: torch.nonzero(x),
        lambda x: torch.nonzero(x, as_tuple=True),
        lambda x: torch.argwhere(x > 0),
        lambda x: x[x > 0],
        lambda x: torch.masked_select(x, x < 1),
        lambda x: torch.unique(x),
        lambda x: torch.unique(x.round(), return_counts=True, return_inverse=True),
        lambda x: torch.unique_consecutive(x.flatten().round(), return_counts=True),
        lambda x: torch.unique(x.long(), dim=0),
        lambda x: torch.where(x > 0),
        lambda x: torch.bincount((x.abs() * 2).long().flatten()),
        lambda x: torch.repeat_interleave(
            torch.arange(3, device=x.device), torch.tensor([1, 0, 2], device=x.device)
        ),
    ],
)
def test_data_dependent_ops_match_cpu_with_one_wait(dev, counted, fn):
    expected = fn(CPU)
    r = CPU.to(dev)
    torch.rgpu.synchronize()
    before = rgpu.stats()["waits"]
    got = fn(r)
    assert rgpu.stats()["waits"] - before == 1
    flat_got = got if isinstance(got, tuple) else (got,)
    flat_exp = expected if isinstance(expected, tuple) else (expected,)
    for g, e in zip(flat_got, flat_exp):
        assert g.shape == e.shape and g.dtype == e.dtype
    # the outputs stream onward: more work on them costs no further wait
    mid = rgpu.stats()["waits"]
    more = [g.float() * 2 + 1 for g in flat_got]
    assert rgpu.stats()["waits"] == mid
    for m, e in zip(more, flat_exp):
        assert torch.equal(m.cpu(), e.float() * 2 + 1)


def test_boolean_mask_assignment_streams(dev, counted):
    c, r = CPU.clone(), CPU.to(dev)
    c[c > 0] = 0.0
    r[r > 0] = 0.0
    assert counted()["waits"] == 0
    assert torch.equal(r.cpu(), c)


def test_equal_allclose_and_any(dev):
    a = CPU.to(dev)
    assert torch.equal(a, a.clone()) is True
    assert torch.equal(a, a + 1) is False
    assert torch.allclose(a, a + 1e-9)
    assert not torch.allclose(a, a + 1)
    assert bool((a > 3).any()) is True
    assert bool((a > 30).any()) is False


def test_ops_without_a_meta_kernel_ask_the_server(dev, counted):
    # histogram has no meta kernel (and only a CPU one: a CPU server runs it; CUDA would refuse)
    expected = torch.histogram(CPU, bins=4)
    got = torch.histogram(CPU.to(dev), bins=4)
    assert counted()["waits"] == 1  # RUN_DYN: the server runs it and says what it made
    assert got.hist.device.type == "rgpu"
    assert torch.equal(got.hist.cpu(), expected.hist)
    assert torch.equal(got.bin_edges.cpu(), expected.bin_edges)
    torch.manual_seed(5)
    counts = torch.tensor([5.0, 2.5, 7.0])
    expected = torch.binomial(counts, torch.tensor([0.5, 0.2, 0.9]))
    torch.manual_seed(5)
    got = torch.binomial(counts.to(dev), torch.tensor([0.5, 0.2, 0.9], device=dev))
    assert torch.equal(got.cpu(), expected)
