"""COMPILE and CALL: shipped graphs built once per session (shared across sessions by content,
see graphs.py) and run with the session's tensors and generator."""

from __future__ import annotations

from typing import Any

import torch

from rgpu_protocol import ProtocolError

from . import graphs, rng
from .poison import Poison, describe
from .state import SessionState


def compile_graph(s: SessionState, seq: int, msg: list) -> None:
    _, key, nodes, compiler, mode = msg
    if compiler not in graphs.COMPILERS:
        raise ProtocolError("COMPILE takes a key, nodes, a compiler (inductor or eager) and a mode")
    if key in s.graphs:
        return
    try:
        s.graphs[key] = graphs.CACHE.get_or_build(nodes, compiler, mode, s.device)
    except graphs.GraphRefused as e:
        _fail_graph(s, key, f"OpRefused: {e}")
    except ProtocolError:
        raise
    except Exception as e:
        _fail_graph(s, key, describe(e))


def _fail_graph(s: SessionState, key: str, message: str) -> None:
    poison = Poison(f"compiled graph {key[:12]}", message, s.current_seq)
    s.graphs[key] = poison
    if s.first_error is None:
        s.first_error = (poison.label, message, s.current_seq)


def call_graph(s: SessionState, seq: int, msg: list) -> None:
    _, key, inputs, outs = msg
    label = f"compiled graph {key[:12]}"
    graph = s.graphs.get(key)
    if graph is None:
        s.fail(f"graph {key[:12]}", "RuntimeError: this graph was never compiled in this session",
               outs)  # fmt: skip
        return
    if type(graph) is Poison:
        for i in outs:
            if i is not None:
                s.tensors[i] = graph
        return
    if s.bad is not None:
        s.pass_on_bad(label, outs)
        return
    try:
        result = graphs.timed_first_call(graph, lambda: _run(s, graph, inputs))
    except Exception as e:
        s.fail(label, describe(e), outs)
        return
    s.ops_run += 1
    result = list(result) if isinstance(result, (list, tuple)) else [result]
    if len(result) != len(outs):
        s.fail(label, f"graph returned {len(result)} values, client expected {len(outs)}", outs)
        return
    for i, v in zip(outs, result):
        if i is not None:
            if type(i) is not int:
                raise ProtocolError("output ids must be integers or null")
            if isinstance(v, torch.Tensor):
                s.tensors[i] = v
    if s.quota is not None:
        s.charge(label, outs)


def _run(s: SessionState, graph: graphs.Graph, inputs: list) -> Any:
    with torch.no_grad():
        if not graph.seeded:
            return graph.fn(*inputs)
        with rng.session_state(s.generator, s.device):
            return graph.fn(*inputs)
