"""One rank of a DistributedDataParallel job on rgpu devices, as torchrun starts it.

`python tests/ddp_worker.py STEPS OUT.json` with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
and RGPU_SERVER set: rank r trains on rgpu:r with the "rgpu" c10d backend, on its slice of each
global batch, and writes its losses, final parameters and counters as JSON. `model()` and
`batches()` are shared with the single-process reference (tests/test_ddp.py) and the benchmark.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256), torch.nn.Tanh(),
        torch.nn.Linear(256, 4),
    )  # fmt: skip


def batches(steps: int, size: int = 32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(size, 16, generator=g), torch.randn(size, 4, generator=g))
            for _ in range(steps)]  # fmt: skip


def reference(steps: int) -> tuple[list[float], list[torch.Tensor]]:
    """One process, the whole batch, on the CPU."""
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for x, y in batches(steps):
        loss = torch.nn.functional.mse_loss(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach() for p in net.parameters()]


def collectives(rank: int, world: int) -> dict:
    """Each collective of the backend once, on rgpu:rank; the values it produced."""
    import torch.distributed as dist

    dev = f"rgpu:{rank}"
    out: dict = {}
    x = torch.arange(4.0, device=dev) + rank
    dist.all_reduce(x)
    out["all_reduce_sum"] = x.tolist()
    y = torch.full((3,), float(rank + 1), device=dev)
    dist.all_reduce(y, op=dist.ReduceOp.MAX)
    out["all_reduce_max"] = y.tolist()
    z = torch.full((2,), float(rank), device=dev)
    dist.all_reduce(z, op=dist.ReduceOp.AVG)
    out["all_reduce_avg"] = z.tolist()
    b = torch.full((2,), float(rank + 10), device=dev)
    dist.broadcast(b, src=world - 1)
    out["broadcast"] = b.tolist()
    gathered = [torch.empty(2, device=dev) for _ in range(world)]
    dist.all_gather(gathered, torch.full((2,), float(rank), device=dev))
    out["all_gather"] = [g.tolist() for g in gathered]
    flat = torch.empty(2 * world, device=dev)
    dist.all_gather_into_tensor(flat, torch.full((2,), float(rank), device=dev))
    out["all_gather_into_tensor"] = flat.tolist()
    rs = torch.empty(2, device=dev)
    dist.reduce_scatter(rs, [torch.full((2,), float(rank + k), device=dev) for k in range(world)])
    out["reduce_scatter"] = rs.tolist()
    rst = torch.empty(2, device=dev)
    dist.reduce_scatter_tensor(rst, torch.arange(2.0 * world, device=dev) * (rank + 1))
    out["reduce_scatter_tensor"] = rst.tolist()
    r = torch.full((2,), float(rank + 1), device=dev)
    dist.reduce(r, dst=1, op=dist.ReduceOp.SUM)
    out["reduce"] = r.tolist() if rank == 1 else None  # other ranks' are unspecified
    wanted = [torch.empty(2, device=dev) for _ in range(world)] if rank == 0 else None
    dist.gather(torch.full((2,), float(2 * rank), device=dev), wanted, dst=0)
    out["gather"] = [g.tolist() for g in wanted] if rank == 0 else None
    mine = torch.empty(2, device=dev)
    parts = [torch.full((2,), 10.0 * k, device=dev) for k in range(world)]
    dist.scatter(mine, parts if rank == world - 1 else None, src=world - 1)
    out["scatter"] = mine.tolist()
    exchanged = torch.empty(2 * world, device=dev)
    dist.all_to_all_single(exchanged, torch.arange(2.0 * world, device=dev) + 100 * rank)
    out["all_to_all_single"] = exchanged.tolist()
    uneven = torch.empty((rank + 1) * world, device=dev)  # rank k sends k + 1 to each rank
    dist.all_to_all_single(uneven, torch.full((sum(range(1, world + 1)),), float(rank), device=dev),
                           [rank + 1] * world, [k + 1 for k in range(world)])  # fmt: skip
    out["all_to_all_uneven"] = uneven.tolist()
    outs = [torch.empty(1, 2, device=dev) for _ in range(world)]
    dist.all_to_all(outs, [torch.full((1, 2), 10.0 * rank + k, device=dev) for k in range(world)])
    out["all_to_all"] = [o.tolist() for o in outs]
    dist.barrier()
    try:
        dist.send(torch.ones(2, device=dev), dst=(rank + 1) % world)
    except NotImplementedError as e:
        out["send"] = str(e)
    try:
        dist.all_reduce(torch.ones(2))  # a CPU tensor
    except ValueError as e:
        out["cpu_tensor"] = str(e)
    return out


def launch(
    url: str,
    world: int,
    steps: int,
    workdir: str,
    timeout: float = 600,
    what: str = "train",
    deterministic_rank: int | None = None,
) -> list[dict]:
    """Run `world` ranks as torchrun would (one process each, env:// rendezvous on a free
    port) against the server at `url`; their results, by rank. `deterministic_rank`: that rank
    alone runs with torch.use_deterministic_algorithms(True)."""
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "RGPU_SERVER": url,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "DETERMINISTIC": str(rank == deterministic_rank),
        }
        out = os.path.join(workdir, f"rank{rank}.json")
        procs.append((subprocess.Popen([sys.executable, __file__, str(steps), out, what], env=env,
                                       stderr=subprocess.PIPE, text=True), out))  # fmt: skip
    results = []
    for proc, out in procs:
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p, _ in procs:
                p.kill()
            raise
        if proc.returncode != 0:
            raise RuntimeError(f"a DDP rank failed ({proc.returncode}):\n{err[-3000:]}")
        with open(out) as f:
            results.append(json.load(f))
    return results


def main() -> None:
    import torch.distributed as dist

    import rgpu

    steps, out = int(sys.argv[1]), sys.argv[2]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.rgpu.set_device(rank)  # connects to RGPU_SERVER
    if os.environ.get("DETERMINISTIC") == "True":
        torch.use_deterministic_algorithms(True)
    dist.init_process_group("rgpu")  # env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
    if sys.argv[3:] == ["collectives"]:
        result = collectives(rank, world)
        dist.destroy_process_group()
        with open(out, "w") as f:
            json.dump(result, f)
        rgpu.disconnect()
        return
    net = model().to(f"rgpu:{rank}")
    ddp = torch.nn.parallel.DistributedDataParallel(net, device_ids=[rank])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    data = batches(steps)
    losses, times, stats = [], [], []
    for x, y in data:
        before = rgpu.stats()
        t0 = time.perf_counter()
        xb, yb = x.chunk(world)[rank], y.chunk(world)[rank]
        loss = torch.nn.functional.mse_loss(ddp(xb), yb.to(f"rgpu:{rank}"))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())  # one wait per step
        times.append(time.perf_counter() - t0)
        after = rgpu.stats()
        stats.append(
            {k: after[k] - before[k] for k in ("messages", "waits", "bytes_out", "bytes_in")}
        )
    params = [p.detach().cpu().tolist() for p in net.parameters()]
    dist.barrier()
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump({"rank": rank, "losses": losses, "params": params, "times": times,
                   "stats": stats, "backend": ddp.process_group.server_backend}, f)  # fmt: skip
    rgpu.disconnect()


if __name__ == "__main__":
    main()
