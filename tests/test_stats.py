"""Exact message and wait counts: the batching contract, as regression tests."""

from __future__ import annotations

import torch

import rgpu


def test_stats_has_the_documented_counters(dev, server):
    s = rgpu.stats()
    assert set(s) >= {"messages", "waits", "bytes_out", "bytes_in", "frames", "wait_seconds"}
    rgpu.disconnect()
    zeros = rgpu.stats()  # without a session: the same counters, all zero
    assert zeros == dict.fromkeys(s, 0) and set(zeros) == set(s)
    rgpu.connect(server.url)


def test_a_loop_of_ops_then_one_item_is_one_wait(dev, counted):
    x = torch.zeros(16, device=dev)
    for _ in range(100):
        x = x + 1
    assert counted()["waits"] == 0
    assert x.sum().item() == 1600.0
    d = counted()
    assert d["waits"] == 1
    # zeros, 100 adds, sum, one FREE for the 100 dropped temporaries (sent with the wait), the download
    assert d["messages"] == 104
    assert d["frames"] >= 1 and d["bytes_out"] > 0 and d["bytes_in"] > 0 and d["wait_seconds"] > 0


def test_each_download_kind_is_one_wait(dev, counted):
    x = torch.arange(6.0, device=dev)
    x.cpu()
    x.tolist()
    x.numpy()
    x[0].item()
    bool(x[1])
    repr(x)
    torch.rgpu.synchronize()
    assert counted()["waits"] == 7


def test_threshold_flushes_never_wait(dev, counted):
    x = torch.zeros(4, device=dev)
    for _ in range(1000):  # several flushes by count
        x = x + 1
    d = counted()
    assert d["waits"] == 0 and d["frames"] >= 1000 // 128
    assert x[0].item() == 1000.0


def test_the_queue_goes_out_when_the_client_goes_quiet(dev, session):
    import time

    x = torch.ones(3, device=dev) * 5
    frames = rgpu.stats()["frames"]
    deadline = time.time() + 2
    while rgpu.stats()["frames"] == frames and time.time() < deadline:
        time.sleep(0.001)
    assert rgpu.stats()["frames"] == frames + 1  # sent without any wait
    assert session.stream.pending == 0
    del x


def test_view_ops_cost_no_message(dev, counted):
    x = torch.arange(24.0, device=dev).reshape(4, 6)  # arange (reshape of a fresh tensor is a view)
    before = rgpu.stats()["messages"]
    views = [
        x.t(),
        x.view(2, 12),
        x[1],
        x[:, 2:4],
        x.detach(),
        x.expand(2, 4, 6),
        x.unsqueeze(0),
        x.permute(1, 0),
    ]
    views += list(x.unbind(0)) + list(x.split(2, dim=1))
    assert rgpu.stats()["messages"] == before
    # ... and they behave as real views: reads, writes through them, and views of views
    x.t()[0].mul_(10)
    x.view(2, 12)[1, ::2].add_(0.5)
    c = torch.arange(24.0).reshape(4, 6)
    c.t()[0].mul_(10)
    c.view(2, 12)[1, ::2].add_(0.5)
    assert torch.equal(x.cpu(), c)
    for v, vc in zip(views[:4], [c.t(), c.view(2, 12), c[1], c[:, 2:4]]):
        assert torch.equal(v.cpu(), vc)


def test_a_view_keeps_its_base_alive_on_the_server(dev, session):
    x = torch.arange(6.0, device=dev)
    v = x[2:]
    del x
    import gc

    gc.collect()
    torch.rgpu.synchronize()
    assert torch.equal(v.cpu(), torch.arange(2.0, 6.0))
    v.t_() if v.dim() == 2 else v.unsqueeze_(
        0
    )  # metadata change on a lazy view: it gets its own entry
    assert v.shape == (1, 4) and torch.equal(v.cpu(), torch.arange(2.0, 6.0).unsqueeze(0))


def test_torch_tensor_is_one_message_and_its_upload(dev, counted):
    # empty_strided and the UPLOAD of its bytes; `lift_fresh`, which torch.tensor ends with,
    # returns its argument and sends nothing; an empty tensor has no bytes to upload
    t = torch.tensor([[1.5, -2.0], [0.0, 3.25]], device=dev)
    assert counted()["messages"] == 2
    e = torch.tensor([], device=dev)
    assert counted()["messages"] == 3
    g = torch.tensor([1.0, 2.0], device=dev, requires_grad=True)
    assert counted()["messages"] == 5 and g.is_leaf and g.requires_grad
    assert torch.equal(t.cpu(), torch.tensor([[1.5, -2.0], [0.0, 3.25]]))
    assert e.cpu().shape == (0,) and e.stride() == torch.tensor([]).stride()
    assert torch.equal(torch.cat([e, g.detach()]).cpu(), torch.tensor([1.0, 2.0]))
