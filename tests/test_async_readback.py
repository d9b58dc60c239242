"""Non-blocking readback and events: logging a loss costs no wait, as with CUDA streams.

`x.to("cpu", non_blocking=True)` and `cpu.copy_(x, non_blocking=True)` return at once; the bytes
land when the reply does. `rgpu.Event` marks a point in the op stream without waiting.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from fault_proxy import FaultProxy

import rgpu
from rgpu.models import seed_mlp


def test_non_blocking_to_cpu_costs_no_wait_and_is_right_after_synchronize(counted):
    x = torch.arange(12.0).reshape(3, 4)
    r = x.to("rgpu")
    before = counted()
    y = (r * 2 + 1).to("cpu", non_blocking=True)
    z = r.t().to("cpu", non_blocking=True)  # a transposed view keeps its strides
    h = r.half().to("cpu", dtype=torch.float32, non_blocking=True)  # dtype change on the server
    after = counted()
    assert after["waits"] == before["waits"]
    assert after["async_readbacks"] - before["async_readbacks"] == 3
    torch.rgpu.synchronize()
    assert torch.equal(y, x * 2 + 1)
    assert torch.equal(z, x.t()) and z.stride() == x.t().stride()
    assert h.dtype == torch.float32 and torch.equal(h, x)


def test_non_blocking_copy_into_a_cpu_tensor(dev):
    x = torch.randn(5, 7)
    r = x.to(dev)
    same = torch.empty(5, 7)
    wider = torch.empty(5, 7, dtype=torch.float64)
    strided = torch.empty(7, 5).t()  # a non-contiguous destination
    broadcast = torch.empty(3, 5, 7)
    for dst in (same, wider, strided):
        assert dst.copy_(r, non_blocking=True) is dst
    broadcast.copy_(r, non_blocking=True)
    torch.rgpu.synchronize()
    assert torch.equal(same, x)
    assert torch.equal(wider, x.double())
    assert torch.equal(strided, x)
    assert torch.equal(broadcast, x.expand(3, 5, 7))
    with pytest.raises(RuntimeError, match="must match the size"):
        torch.empty(2, 2).copy_(r, non_blocking=True)


def test_training_loop_logging_losses_without_waits(counted):
    torch.manual_seed(0)
    model = seed_mlp()
    x, y = torch.randn(64, 16), torch.randn(64, 1)
    reference = []
    cpu_model = seed_mlp()
    cpu_model.load_state_dict(model.state_dict())
    cpu_opt = torch.optim.SGD(cpu_model.parameters(), lr=0.05)
    for _ in range(10):
        cpu_opt.zero_grad()
        loss = F.mse_loss(cpu_model(x), y)
        loss.backward()
        cpu_opt.step()
        reference.append(loss.detach())

    model = model.to("rgpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    xr, yr = x.to("rgpu"), y.to("rgpu")
    torch.rgpu.synchronize()
    start = counted()
    logged = []
    for _ in range(10):
        opt.zero_grad()
        loss = F.mse_loss(model(xr), yr)
        loss.backward()
        opt.step()
        logged.append(loss.detach().to("cpu", non_blocking=True))
    during = counted()
    assert during["waits"] == start["waits"], "a non-blocking loss readback waited"
    torch.rgpu.synchronize()
    assert counted()["waits"] == start["waits"] + 1
    torch.testing.assert_close(torch.stack(logged), torch.stack(reference), rtol=1e-5, atol=1e-6)


def test_event_record_query_synchronize_and_elapsed_time(counted):
    a = torch.randn(1500, 1500, device="rgpu")
    start = rgpu.Event(enable_timing=True)
    end = torch.rgpu.Event(enable_timing=True)
    assert start.query()  # never recorded: nothing to wait for
    before = counted()["waits"]
    start.record()
    for _ in range(6):  # seconds of work on a 2-core CPU server: the end is not reached yet
        a = (a @ a).tanh()
    end.record()
    assert counted()["waits"] == before  # recording costs no wait
    assert not end.query()
    with pytest.raises(RuntimeError, match="synchronize"):
        start.elapsed_time(end)
    end.synchronize()
    assert counted()["waits"] == before + 1
    assert end.query() and start.query()
    assert counted()["waits"] == before + 1  # known to be done: no more waits
    ms = start.elapsed_time(end)
    t0 = rgpu.Event(enable_timing=True)
    t0.record()
    t1 = rgpu.Event(enable_timing=True)
    t1.record()
    t1.synchronize()
    assert ms > 10 * t0.elapsed_time(t1) and ms < 120_000.0  # the work is between the marks
    plain = rgpu.Event()
    plain.record()
    plain.synchronize()
    with pytest.raises(RuntimeError, match="enable_timing"):
        plain.elapsed_time(end)


def test_a_failing_readback_reports_at_the_next_wait_once(dev):
    bad = torch.ones(2, device=dev)[torch.tensor([5], device=dev)]
    out = bad.to("cpu", non_blocking=True)
    assert out.shape == (1,)
    with pytest.raises(rgpu.RemoteError, match="out of bounds"):
        torch.rgpu.synchronize()
    assert (torch.ones(3, device=dev) * 2).sum().item() == 6.0  # reported once; session fine


def test_a_failing_op_before_an_event_is_raised_by_the_event(dev):
    bad = torch.ones(2, device=dev)[torch.tensor([7], device=dev)]
    event = rgpu.Event()
    event.record()
    with pytest.raises(rgpu.RemoteError, match="out of bounds"):
        event.synchronize()
    torch.rgpu.synchronize()  # not raised a second time
    del bad


def test_non_blocking_readbacks_survive_a_dropped_connection(server):
    proxy = FaultProxy(int(server.url.rsplit(":", 1)[1]))
    try:
        session = rgpu.connect(proxy.url)
        x = torch.randn(200_000)  # 800 KB replies: cut mid-reply below
        r = x.to("rgpu")
        torch.rgpu.synchronize()
        outs = []
        for i in range(6):
            outs.append((r + i).to("cpu", non_blocking=True))
            if i == 2:
                threading.Timer(0.0, proxy.cut_all).start()
        torch.rgpu.synchronize()
        for i, out in enumerate(outs):
            assert torch.equal(out, x + i), f"readback {i} is wrong after the cut"
        assert session.reconnects >= 1
    finally:
        rgpu.disconnect()
        proxy.close()
