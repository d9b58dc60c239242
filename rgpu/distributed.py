"""The "rgpu" c10d backend: `torch.distributed.init_process_group("rgpu", ...)` in N client
processes (torchrun, torch.multiprocessing), so `DistributedDataParallel` trains on rgpu devices.

Each rank is a client process with its own session. Its process group joins a group on the
server (GROUP: the server makes that rank's own torch.distributed process group, gloo for CPU
devices, NCCL for CUDA devices, and the reply comes once every rank has joined). Every
collective then goes out as one COLLECTIVE message that the server runs on its tensors: the
bytes DDP reduces never leave the server. A collective costs no wait: it is queued like an op
and the returned `Work` is already complete, because the server runs the session's messages in
order, so whatever reads the result comes after it (as an NCCL collective is ordered on its
CUDA stream). `barrier()`'s Work waits for the server, so the barrier holds on the client too.

All ranks' devices must be on one rgpu server process (its virtual devices, or its GPUs), the
rank's device being the current one at `init_process_group` (`torch.rgpu.set_device(rank)`, as
with NCCL): the server's process groups meet in an in-process store.
"""

from __future__ import annotations

import secrets
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rgpu_protocol import REDUCE_OPS, Kind

from . import current as _cur
from . import devices as _devices
from .tensor import RemoteTensor

BACKEND = "rgpu"


def _done(result: Any) -> Any:
    from torch._C._distributed_c10d import _create_work_from_future

    future: torch.futures.Future = torch.futures.Future()
    future.set_result(result)
    return _create_work_from_future(future)


def _reduce_name(op: Any) -> str:
    for name in REDUCE_OPS:
        if op == getattr(dist.ReduceOp, name.upper()):
            return name
    raise NotImplementedError(f"the rgpu backend does not support the reduce op {op}")


class RgpuProcessGroup(dist.ProcessGroup):
    """One rank of a process group whose collectives run on the rgpu server."""

    def __init__(self, store: Any, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)
        sess = _cur.current()
        self.device = _devices.current()
        self.session, self.local = _devices.session_of(self.device, sess)
        if rank == 0:
            store.set("rgpu/group", secrets.token_hex(16))
        self.key = store.get("rgpu/group").decode()
        store.set(f"rgpu/server/{rank}", self.session.welcome.server_id.hex())
        servers = {store.get(f"rgpu/server/{r}") for r in range(size)}
        if len(servers) > 1:
            raise NotImplementedError(
                "the rgpu backend needs every rank's device on one rgpu server (its GPUs, or "
                "its --virtual-devices); these ranks use several servers"
            )
        seconds = timeout.total_seconds() if timeout is not None else 1800.0
        self.server_backend = self.session.request(
            (Kind.GROUP, self.key, rank, size, float(seconds)), device=self.local
        )

    def getBackendName(self) -> str:  # noqa: N802 (c10d's name)
        return BACKEND

    def __repr__(self) -> str:
        return f"RgpuProcessGroup(rank={self.rank()}, size={self.size()}, rgpu:{self.device})"

    # -- collectives ---------------------------------------------------------------------------

    def _post(self, op: str, tensors: list, flat: list, options: dict | None = None) -> None:
        for t in flat:
            if type(t) is not RemoteTensor:
                raise ValueError(
                    f"the rgpu backend runs collectives on rgpu tensors, not on {t.device} "
                    "tensors (for those, make a gloo group: dist.new_group(backend='gloo'))"
                )
            if t._r.dev != self.device:
                raise ValueError(
                    f"this process group runs on rgpu:{self.device} (the current device when it "
                    f"was made), not on {t.device}"
                )
        self.session.post((Kind.COLLECTIVE, self.key, op, tensors, options), device=self.local)

    def allreduce(self, tensors: list, opts: Any = None) -> Any:
        op = _reduce_name(opts.reduceOp) if opts is not None else "sum"
        self._post("all_reduce", list(tensors), list(tensors), {"op": op})
        return _done(list(tensors))

    def allreduce_coalesced(self, tensors: list, opts: Any = None) -> Any:
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors: list, opts: Any = None) -> Any:
        root = opts.rootRank if opts is not None else 0
        self._post("broadcast", list(tensors), list(tensors), {"root": root})
        return _done(list(tensors))

    def allgather(self, output_lists: list, inputs: list, opts: Any = None) -> Any:
        if len(inputs) != 1:
            raise ValueError("the rgpu backend gathers one tensor per rank")
        outputs = list(output_lists[0])
        self._post("all_gather", [outputs, inputs[0]], [*outputs, inputs[0]])
        return _done(output_lists)

    def all_gather_single(self, output: Any, input: Any, opts: Any = None) -> Any:
        self._post("all_gather_into_tensor", [output, input], [output, input])
        return _done([output])

    _allgather_base = all_gather_single  # its name before torch 2.13

    def all_gather_single_coalesced(self, outputs: list, inputs: list, opts: Any = None) -> Any:
        for output, input in zip(outputs, inputs):
            self.all_gather_single(output, input, opts)
        return _done(list(outputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(self, outputs: list, input_lists: list, opts: Any = None) -> Any:
        if len(outputs) != 1:
            raise ValueError("the rgpu backend reduce-scatters into one tensor per rank")
        op = _reduce_name(opts.reduceOp) if opts is not None else "sum"
        inputs = list(input_lists[0])
        self._post("reduce_scatter", [outputs[0], inputs], [outputs[0], *inputs], {"op": op})
        return _done(outputs)

    def reduce_scatter_single(self, output: Any, input: Any, opts: Any = None) -> Any:
        op = _reduce_name(opts.reduceOp) if opts is not None else "sum"
        self._post("reduce_scatter_tensor", [output, input], [output, input], {"op": op})
        return _done([output])

    _reduce_scatter_base = reduce_scatter_single  # its name before torch 2.13

    def reduce_scatter_single_coalesced(self, outputs: list, inputs: list, opts: Any = None) -> Any:
        for output, input in zip(outputs, inputs):
            self.reduce_scatter_single(output, input, opts)
        return _done(list(outputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def reduce(self, tensors: list, opts: Any = None) -> Any:
        op = _reduce_name(opts.reduceOp) if opts is not None else "sum"
        root = opts.rootRank if opts is not None else 0
        self._post("reduce", list(tensors), list(tensors), {"op": op, "root": root})
        return _done(list(tensors))

    def gather(self, output_lists: list, inputs: list, opts: Any = None) -> Any:
        if len(inputs) != 1:
            raise ValueError("the rgpu backend gathers one tensor per rank")
        outputs = list(output_lists[0]) if output_lists else []  # the root's; none elsewhere
        root = opts.rootRank if opts is not None else 0
        self._post("gather", [outputs, inputs[0]], [*outputs, inputs[0]], {"root": root})
        return _done(output_lists)

    def scatter(self, outputs: list, input_lists: list, opts: Any = None) -> Any:
        if len(outputs) != 1:
            raise ValueError("the rgpu backend scatters into one tensor per rank")
        inputs = list(input_lists[0]) if input_lists else []  # the root's; none elsewhere
        root = opts.rootRank if opts is not None else 0
        self._post("scatter", [outputs[0], inputs], [outputs[0], *inputs], {"root": root})
        return _done(outputs)

    def alltoall_base(
        self, output: Any, input: Any, out_splits: list, in_splits: list, opts: Any = None
    ) -> Any:
        options = {"out_splits": [int(n) for n in out_splits],
                   "in_splits": [int(n) for n in in_splits]}  # fmt: skip
        self._post("all_to_all_single", [output, input], [output, input], options)
        return _done([output])

    def alltoall(self, outputs: list, inputs: list, opts: Any = None) -> Any:
        """`all_to_all` of tensor lists, as one `all_to_all_single` of their concatenation
        (gloo has no list form): rows along dim 0, the rest of each tensor's shape alike."""
        rows = {tuple(t.shape[1:]) for t in (*outputs, *inputs)}
        if len(rows) > 1 or any(t.dim() == 0 for t in (*outputs, *inputs)):
            raise ValueError(
                "the rgpu backend exchanges tensors of one shape past dim 0 in all_to_all; use "
                "all_to_all_single with split sizes"
            )
        flat_in = torch.cat([t.reshape(t.shape[0], -1) for t in inputs])
        flat_out = torch.empty(
            (sum(t.shape[0] for t in outputs), *flat_in.shape[1:]),
            dtype=flat_in.dtype, device=flat_in.device,
        )  # fmt: skip
        self.alltoall_base(flat_out, flat_in, [t.shape[0] for t in outputs],
                           [t.shape[0] for t in inputs])  # fmt: skip
        for t, part in zip(outputs, flat_out.split([t.shape[0] for t in outputs])):
            t.copy_(part.reshape(t.shape))
        return _done(list(outputs))

    def _point_to_point(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            "the rgpu backend has no point-to-point send/recv: use broadcast, scatter or "
            "all_to_all on rgpu tensors, or a gloo group for CPU tensors "
            "(dist.new_group(backend='gloo'))"
        )

    send = recv = recv_anysource = _point_to_point

    def barrier(self, opts: Any = None) -> Any:
        self._post("barrier", [], [])
        self.session.synchronize(device=self.local)  # every rank's stream reached it
        return _done(None)


def _create(store: Any, rank: int, size: int, timeout: timedelta) -> RgpuProcessGroup:
    return RgpuProcessGroup(store, rank, size, timeout)


def install() -> None:
    """Register the backend with torch.distributed (at `import rgpu`; no network)."""
    if dist.is_available() and BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, devices=[BACKEND])
