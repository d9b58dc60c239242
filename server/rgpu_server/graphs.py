"""Shipped graphs: rebuilt from rgpu's node list as FX graphs and compiled for this device.

A graph is known by the hash of its content. Compiled graphs are shared by every session of this
process, and Inductor's own on-disk cache (under the compile cache directory) makes a graph this
server compiled before, even in an earlier run, start fast.
"""

from __future__ import annotations

import hashlib
import logging
import operator
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx

from rgpu_protocol import (
    GRAPH_CONSTANT_BYTES,
    Encoder,
    HostData,
    NodeRef,
    NodeTag,
    ProtocolError,
)

from .ops import CALLS, OpRefused, resolve

log = logging.getLogger("rgpu_server")
COMPILERS = ("inductor", "eager")
MAX_NODES = 200_000
_CANON = Encoder().encode


def _hashable(nodes: Any) -> Any:
    """The nodes with each constant tensor as its bytes, as the client sent it."""
    if type(nodes) is not list:
        return nodes
    return [
        [NodeTag.CONSTANT, HostData(n[1].dtype, tuple(n[1].shape), _bytes(n[1]))]
        if type(n) is list and len(n) == 2 and n[0] == NodeTag.CONSTANT
        and isinstance(n[1], torch.Tensor)
        else n
        for n in nodes
    ]  # fmt: skip


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def configure_cache(path: str | None) -> Path:
    """Point Inductor's on-disk caches at our cache directory (before Inductor is imported)."""
    root = Path(path) if path else Path.home() / ".cache" / "rgpu"
    root.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))
    return root


def _warm_up_graph(x: torch.Tensor) -> torch.Tensor:
    return (x * 2 + 1).relu()


def preload_inductor(device: torch.device) -> None:
    """Import Inductor and compile a tiny graph, before the server takes clients.

    A fresh server otherwise adds about 2 s of imports and as much of first-compile set-up to its
    first client's compiled graph, even one that Inductor's on-disk cache already holds. It runs
    before serving, not on a background thread: Dynamo compiling on one thread while session
    threads start and compile made those sessions' graphs run uncompiled."""
    t0 = time.perf_counter()
    try:
        import torch._inductor.compile_fx  # noqa: F401

        torch.compile(_warm_up_graph, backend="inductor", dynamic=False)(
            torch.ones(8, device=device)
        )
    except Exception:  # a torch without Inductor: graphs are compiled with "eager" only
        log.warning(
            "could not preload Inductor; the first compiled graph will be slower", exc_info=True
        )
        return
    log.info(
        "Inductor preloaded in %.1f s (imported, one graph compiled)", time.perf_counter() - t0
    )


@dataclass
class Graph:
    key: str
    fn: Any  # callable(*inputs) -> tuple of outputs
    n_nodes: int
    seeded: bool  # has random ops: run with the session's RNG state swapped in
    compiler: str
    gm: Any = None  # the FX graph itself: run op by op if Inductor cannot compile it


class GraphCache:
    """Compiled graphs of this process, by content key, and counters that tests and INFO read."""

    def __init__(self) -> None:
        self._graphs: dict[str, Graph] = {}
        self._lock = threading.Lock()
        self._building: dict[str, threading.Lock] = {}  # per key, held while it is built
        self.built = 0  # graphs this process built
        self.reused = 0  # COMPILEs answered from graphs this process already had
        self.compile_seconds = 0.0
        self.fallbacks = 0  # graphs Inductor failed to compile, run op by op instead

    def get_or_build(
        self, nodes: list, compiler: str, mode: str | None, device: torch.device
    ) -> Graph:
        # keyed by what the server decoded, never by a name a client chose: one client cannot
        # plant a different graph under a key another client's graph will be looked up by
        key = hashlib.sha256(_CANON([_hashable(nodes), compiler, mode, str(device)])).hexdigest()
        with self._lock:
            building = self._building.setdefault(key, threading.Lock())
        # one build per key: a second session asking for the same graph while the first builds
        # it waits for that build instead of building (and compiling) its own copy
        with building:
            with self._lock:
                hit = self._graphs.get(key)
                if hit is not None:
                    self.reused += 1
                    return hit
            try:
                gm, seeded = build(nodes, device)
                fn: Any = gm
                if compiler == "inductor":
                    # not fullgraph=True: its check shares one process-wide counter with every
                    # other compiled call, so two sessions' calls at once made it fail
                    # spuriously; a graph of aten calls has nothing to break on anyway.
                    # (Compiling happens at the first call.)
                    fn = torch.compile(gm, backend="inductor", mode=mode, dynamic=False)
            except BaseException:  # refused: its key's lock is not kept for good
                with self._lock:
                    self._building.pop(key, None)
                raise
            graph = Graph(key, fn, len(nodes), seeded, compiler, gm)
            with self._lock:
                self._graphs[key] = graph
                self._building.pop(key, None)
                self.built += 1
                return graph

    def counters(self) -> dict:
        hits = dynamo_graphs = 0
        utils = sys.modules.get("torch._dynamo.utils")
        try:  # Inductor's on-disk FX graph cache: hits mean a compile from an earlier run was reused
            if utils is None:  # nothing compiled yet: do not import Dynamo (seconds) for INFO
                raise LookupError
            counters = utils.counters

            hits = int(counters["inductor"]["fxgraph_cache_hit"])
            # graphs Dynamo really compiled in this process (the preload's included): a graph
            # that ran uncompiled would not count
            dynamo_graphs = int(counters["stats"]["unique_graphs"])
        except Exception:
            pass
        return {
            "graphs_built": self.built,
            "graphs_reused": self.reused,
            "compile_seconds": round(self.compile_seconds, 3),
            "inductor_cache_hits": hits,
            "dynamo_graphs": dynamo_graphs,
            "graphs_run_op_by_op": self.fallbacks,
        }


CACHE = GraphCache()


def build(nodes: Any, device: torch.device) -> tuple[torch.fx.GraphModule, bool]:
    """The FX graph a node list describes (and whether it has random ops); ops are resolved by
    name like single ops."""
    if type(nodes) is not list or not nodes or len(nodes) > MAX_NODES:
        raise ProtocolError("a graph is a non-empty list of nodes")
    graph = torch.fx.Graph()
    root = torch.nn.Module()  # holds the graph's constants
    made: list[torch.fx.Node | None] = []
    seeded = False

    def arg(x: Any) -> Any:
        t = type(x)
        if t is NodeRef:
            if not 0 <= x.index < len(made) or made[x.index] is None:
                raise ProtocolError(f"node reference {x.index} is not an earlier node")
            return made[x.index]
        if t is list:
            return [arg(y) for y in x]
        if t is dict:
            return {k: arg(v) for k, v in x.items()}
        return x  # devices arrive already mapped by the session's decoder

    outputs = None
    for i, node in enumerate(nodes):
        if type(node) is not list or not node or type(node[0]) is not str:
            raise ProtocolError(f"graph node {i} is malformed")
        kind = node[0]
        if kind == NodeTag.PLACEHOLDER and len(node) == 1:
            made.append(graph.placeholder(f"in{i}"))
        elif (
            kind == NodeTag.CALL
            and len(node) == 4
            and type(node[2]) is list
            and type(node[3]) is dict
        ):
            try:
                resolved = resolve(node[1])
            except OpRefused as e:
                raise GraphRefused(str(e)) from None
            seeded = seeded or resolved.seeded or resolved.takes_generator
            target = CALLS.get(node[1], resolved.op)  # a kernel this backend replaces
            made.append(graph.call_function(target, tuple(arg(node[2])), arg(node[3])))
        elif (
            kind == NodeTag.GETITEM
            and len(node) == 3
            and type(node[1]) is int
            and type(node[2]) is int
        ):
            made.append(graph.call_function(operator.getitem, (arg(NodeRef(node[1])), node[2])))
        elif kind == NodeTag.CONSTANT and len(node) == 2 and isinstance(node[1], torch.Tensor):
            constant = node[1]
            if constant.device.type != "cpu" or constant.nbytes > GRAPH_CONSTANT_BYTES:
                raise ProtocolError(f"graph node {i}: a constant is a small CPU tensor")
            root.register_buffer(f"k{i}", constant)
            made.append(graph.get_attr(f"k{i}"))
        elif kind == NodeTag.OUTPUT and len(node) == 2 and type(node[1]) is list:
            outputs = tuple(arg(node[1]))
            graph.output(outputs)
            made.append(None)
        else:
            raise ProtocolError(f"graph node {i} ({kind!r}) is malformed")
    if outputs is None:
        raise ProtocolError("a graph needs an output node")
    graph.lint()
    return torch.fx.GraphModule(root, graph), seeded


class GraphRefused(Exception):
    """The graph names an operator this server does not run."""


# Dynamo's compile state is process-wide, and compiling is not something two threads should do at
# once: first calls (where the compiling happens) take this lock, so two sessions' graphs take
# turns. Later calls run without it.
_COMPILE_LOCK = threading.Lock()


def timed_first_call(graph: Graph, call) -> Any:
    """Run a graph; the first call of an Inductor graph compiles it: log how long that took."""
    if getattr(graph, "_timed", False):
        return _or_op_by_op(graph, call)
    t0 = time.perf_counter()
    if graph.compiler == "inductor":
        with _COMPILE_LOCK:
            out = _or_op_by_op(graph, call)
    else:
        out = call()
    graph._timed = True  # type: ignore[attr-defined]
    seconds = time.perf_counter() - t0
    CACHE.compile_seconds += seconds
    log.info(
        "graph %s (%d nodes, %s) ready after %.2f s",
        graph.key[:12],
        graph.n_nodes,
        graph.compiler,
        seconds,
    )
    return out


def _or_op_by_op(graph: Graph, call) -> Any:
    """A graph Inductor fails to compile (at its first call, or a recompile) runs op by op from
    then on, for every session: the same aten ops, so the same results. Only a compile failure
    falls back; an error while running is the op's error."""
    try:
        return call()
    except Exception as e:
        if type(e).__name__ != "BackendCompilerFailed" or graph.gm is None:
            raise
        log.warning("graph %s: Inductor could not compile it, so it runs op by op (%s)",
                    graph.key[:12], str(e).strip().splitlines()[-1][:300])  # fmt: skip
        graph.fn, graph.compiler = graph.gm, "eager"
        CACHE.fallbacks += 1
    return call()
