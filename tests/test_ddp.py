"""DistributedDataParallel on rgpu devices with the "rgpu" c10d backend.

Real rank processes (started as torchrun starts them: RANK, WORLD_SIZE, MASTER_ADDR/PORT) train
on rgpu:0..N-1 of one `rgpu-server --virtual-devices 4`, whose gloo process groups reduce the
gradients. Each step's global-batch loss and the final weights must equal one process training on
the whole batch (within float tolerance), and no gradient bytes may pass through the clients.
"""

from __future__ import annotations

import pytest
import torch
from ddp_worker import launch, model, reference
from rgpu_test_servers import ServerProcess

STEPS = 4


@pytest.fixture(scope="module")
def four():
    srv = ServerProcess("--virtual-devices", "4")
    yield srv
    srv.stop()


@pytest.mark.parametrize("world", [2, 4])
def test_ddp_on_rgpu_devices_matches_one_process_with_the_global_batch(four, tmp_path, world):
    results = launch(four.url, world, STEPS, str(tmp_path))
    ref_losses, ref_params = reference(STEPS)
    # the global batch's loss is the mean of the ranks' losses (equal slices)
    losses = [sum(r["losses"][i] for r in results) / world for i in range(STEPS)]
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    for r in results:
        assert r["backend"] == "gloo"
        for p, ref in zip(r["params"], ref_params):
            torch.testing.assert_close(torch.tensor(p), ref, rtol=1e-5, atol=1e-6)
    grads = sum(p.numel() * 4 for p in model().parameters())
    for r in results:
        # DDP sets up in the first two steps (its buckets are rebuilt after the first, which
        # reads their sizes); from then on, per step:
        for step in r["stats"][2:]:
            assert step["waits"] == 1  # loss.item(): no collective waits
            assert step["bytes_in"] < 64  # the loss, not the gradients
            assert step["bytes_out"] < grads  # ops and the batch's slice, not the gradients


@pytest.mark.parametrize("deterministic_rank", [None, 1])
def test_each_collective_computes_on_the_server(four, tmp_path, deterministic_rank):
    """With one rank in deterministic mode too: a frame waiting in a collective lets the other
    sessions' frames run whatever their settings (they would wait for it, and it for them)."""
    world = 3
    results = launch(four.url, world, 0, str(tmp_path), timeout=300, what="collectives",
                     deterministic_rank=deterministic_rank)  # fmt: skip
    total = sum(range(world))
    for rank, r in enumerate(results):
        assert r["all_reduce_sum"] == [4 * 0 + total + k * world for k in range(4)]
        assert r["all_reduce_max"] == [float(world)] * 3
        assert r["all_reduce_avg"] == [total / world] * 2
        assert r["broadcast"] == [float(world - 1 + 10)] * 2
        assert r["all_gather"] == [[float(k)] * 2 for k in range(world)]
        assert r["all_gather_into_tensor"] == [float(k) for k in range(world) for _ in range(2)]
        assert r["reduce_scatter"] == [float(sum(k + rank for k in range(world)))] * 2
        scale = sum(k + 1 for k in range(world))
        assert r["reduce_scatter_tensor"] == [float((2 * rank + i) * scale) for i in range(2)]
        assert "rgpu tensors" in r["cpu_tensor"]
        if rank == 1:
            assert r["reduce"] == [float(sum(k + 1 for k in range(world)))] * 2
        if rank == 0:
            assert r["gather"] == [[2.0 * k] * 2 for k in range(world)]
        assert r["scatter"] == [10.0 * rank] * 2
        assert r["all_to_all_single"] == [
            100.0 * k + 2 * rank + i for k in range(world) for i in range(2)
        ]
        assert r["all_to_all_uneven"] == [float(k) for k in range(world) for _ in range(rank + 1)]
        assert r["all_to_all"] == [[[10.0 * k + rank] * 2] for k in range(world)]
        assert "no point-to-point" in r["send"]
