"""GROUP and COLLECTIVE: the server side of rgpu's c10d backend (rgpu/distributed.py).

Each client rank (a process of a torchrun or torch.multiprocessing job) has its own session. Its
GROUP message makes this server create that rank's torch.distributed process group — gloo for
CPU devices, NCCL for CUDA devices — over an in-process store shared by the ranks of the group
(every rank of the group is a session of this server process: the client checks that). Creating
it blocks the rank's worker thread until all ranks have joined, as NCCL's communicator set-up
blocks each rank. A COLLECTIVE then runs on the session's own tensors with that process group:
the gradients DDP reduces never leave the server, and the client never waits for a collective.

Blocking is per session: each session has its own worker thread, so a rank whose stream reached
a collective first waits in it for the other ranks' streams, and nothing else stalls. A rank that
never arrives (its client died) makes the others' collectives fail after the group's timeout,
which poisons the tensors they name.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rgpu_protocol import COLLECTIVE_OPS, REDUCE_OPS, ProtocolError, Status

from . import numerics
from .poison import describe
from .state import SessionState

_stores: dict[str, list] = {}  # group key -> [HashStore, ranks joined so far]
_stores_lock = threading.Lock()


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _store(key: str, size: int) -> Any:
    """The in-process store the ranks of group `key` meet in; dropped once all have joined
    (their process groups keep it)."""
    with _stores_lock:
        entry = _stores.get(key)
        if entry is None:
            entry = _stores[key] = [dist.HashStore(), 0]
        entry[1] += 1
        if entry[1] >= size:
            del _stores[key]
        return entry[0]


def make_group(device: torch.device, key: str, rank: int, size: int, timeout: float) -> Any:
    """This rank's torch.distributed process group (blocks until every rank has made its own)."""
    store = dist.PrefixStore(f"rgpu/{key}", _store(key, size))
    if backend_for(device) == "nccl":
        if not dist.is_nccl_available():
            raise RuntimeError("this server's torch has no NCCL; CUDA collectives need it")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timedelta(seconds=timeout)
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._timeout = timedelta(seconds=timeout)
    return dist.ProcessGroupGloo(store, rank, size, opts)


def group(s: SessionState, seq: int, msg: list) -> None:
    """GROUP [key, rank, size, timeout]: join; the reply (the backend's name) comes once every
    rank has joined."""
    _, key, rank, size, timeout = msg
    if s.error_pending(seq):
        return
    if not (0 <= rank < size) or not key:
        raise ProtocolError(f"GROUP needs 0 <= rank < size and a key, not {rank}, {size}")
    if not dist.is_available():
        s.reply(seq, Status.ERROR, ["group", "this server's torch has no torch.distributed"])
        return
    if key in s.groups:
        s.reply(seq, Status.ERROR, ["group", f"this session already joined group {key}"])
        return
    try:
        with numerics.released():  # other ranks join meanwhile, whatever their settings
            s.groups[key] = make_group(s.device, key, rank, size, float(timeout))
    except Exception as e:
        s.reply(seq, Status.ERROR, ["group", describe(e)])
        return
    s.reply(seq, Status.OK, backend_for(s.device))


def collective(s: SessionState, seq: int, msg: list) -> None:
    """COLLECTIVE [key, op, tensors, options]: run it now; a failure poisons the tensors it
    names (the client learns of it at its next wait)."""
    _, key, op, tensors, options = msg
    label = f"c10d::{op}"
    named = list(s.refs.values())
    if op not in COLLECTIVE_OPS:
        raise ProtocolError(f"unknown collective {op!r}")
    if s.bad is not None:
        s.pass_on_bad(label, named)
        return
    pg = s.groups.get(key)
    if pg is None:
        s.fail(label, f"this session has not joined the group {key}", named)
        return
    try:
        with numerics.released():  # waits for the other ranks
            run(pg, op, tensors, options or {})
    except Exception as e:
        s.fail(label, describe(e), named)


def _reduce_op(options: dict) -> Any:
    name = options.get("op", "sum")
    if name not in REDUCE_OPS:
        raise ProtocolError(f"unknown reduce op {name!r}")
    return getattr(dist.ReduceOp, name.upper())


def _reduce(pg: Any, tensors: list, root: int, options: dict) -> None:
    opts = dist.ReduceOptions()
    opts.rootRank = root
    opts.reduceOp = _reduce_op(options)
    pg.reduce(tensors, opts).wait()


def _gather(pg: Any, tensors: list, root: int, options: dict) -> None:
    outputs, input_ = tensors
    opts = dist.GatherOptions()
    opts.rootRank = root
    pg.gather([outputs] if outputs else [], [input_], opts).wait()


def _scatter(pg: Any, tensors: list, root: int, options: dict) -> None:
    output, inputs = tensors
    opts = dist.ScatterOptions()
    opts.rootRank = root
    pg.scatter([output], [inputs] if inputs else [], opts).wait()


_ROOTED = {"reduce": _reduce, "gather": _gather, "scatter": _scatter}


def run(pg: Any, op: str, tensors: list, options: dict) -> None:
    """One collective on this rank's tensors, waited for (a CPU collective) or ordered on the
    device's stream (NCCL)."""
    if op == "barrier":
        pg.barrier().wait()
        return
    if op == "broadcast":
        opts = dist.BroadcastOptions()
        opts.rootRank = int(options.get("root", 0))
        pg.broadcast(tensors, opts).wait()
        return
    if op == "all_gather":
        outputs, input_ = tensors
        pg.allgather([outputs], [input_]).wait()
        return
    if op == "all_gather_into_tensor":
        output, input_ = tensors
        pg._allgather_base(output, input_).wait()
        return
    if op == "all_reduce":
        opts = dist.AllreduceOptions()
        opts.reduceOp = _reduce_op(options)
        pg.allreduce(tensors, opts).wait()
        return
    if op in _ROOTED:
        _ROOTED[op](pg, tensors, int(options.get("root", 0)), options)
        return
    if op == "all_to_all_single":
        output, input_ = tensors
        out_splits = [int(n) for n in options.get("out_splits", [])]
        in_splits = [int(n) for n in options.get("in_splits", [])]
        pg.alltoall_base(output, input_, out_splits, in_splits, dist.AllToAllOptions()).wait()
        return
    opts = dist.ReduceScatterOptions()
    opts.reduceOp = _reduce_op(options)
    if op == "reduce_scatter":
        output, inputs = tensors
        pg.reduce_scatter([output], [inputs], opts).wait()
    else:  # reduce_scatter_tensor
        output, input_ = tensors
        pg._reduce_scatter_base(output, input_, opts).wait()
