"""Server memory follows the client's references: freed tensors are freed there too."""

from __future__ import annotations

import gc

import pytest
import torch

import rgpu


def live(session):
    torch.rgpu.synchronize()
    return session.info()["tensors"]


def test_a_dropped_tensor_is_freed_on_the_server(dev, session):
    base = live(session)
    x = torch.ones(1000, device=dev)
    assert live(session) == base + 1
    del x
    gc.collect()
    assert live(session) == base


def test_ten_thousand_iterations_keep_the_tensor_count_bounded(dev, session):
    base = live(session)
    x = torch.zeros(64, device=dev)
    w = torch.ones(64, device=dev)
    for i in range(10_000):
        x = (x * 0.5 + w).relu()
        if i % 1000 == 0:
            assert live(session) <= base + 8
    assert live(session) <= base + 4
    assert torch.allclose(x.cpu(), torch.full((64,), 2.0))
    del x, w
    assert live(session) == base


def test_autograd_keeps_saved_tensors_until_backward(dev, session):
    base = live(session)
    w = torch.randn(8, 8, device=dev, requires_grad=True)
    for _ in range(50):
        loss = (w @ w).tanh().sum()
        loss.backward()
    del loss
    gc.collect()
    assert live(session) == base + 2  # w and w.grad
    del w
    gc.collect()
    assert live(session) == base


def test_a_freed_id_is_gone_on_the_server(dev, session):
    from rgpu_protocol import Kind, Ref

    x = torch.ones(3, device=dev)
    tid = x._r.id
    del x
    gc.collect()
    torch.rgpu.synchronize()
    with pytest.raises(rgpu.RemoteError, match=f"no tensor with id {tid}"):
        session.request((Kind.DOWNLOAD, Ref(tid)))


def test_memory_allocated_counts_shared_storage_once(dev):
    before = torch.rgpu.memory_allocated()
    x = torch.empty(256, 1024, device=dev)  # 1 MiB
    views = [x[i] for i in range(10)] + [x.t(), x.view(-1)]
    assert torch.rgpu.memory_allocated() - before == 1024 * 1024
    del x, views
    assert torch.rgpu.memory_allocated() == before
