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
    _, key, nodes, compiler, mode = msg[:5]
    if compiler not in graphs.COMPILERS:
        raise ProtocolError("COMPILE takes a key, nodes, a compiler (inductor or eager) and a mode")
    if key in s.graphs:
        return
    if len(msg) > 5 and msg[5] is not None:
        s.graph_layouts[key] = _layouts(msg[5])
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
    layouts = s.graph_layouts.get(key)
    if layouts is not None and len(layouts) == len(result):
        result = [v if want is None else _conform(v, want) for v, want in zip(result, layouts)]
    for i, v in zip(outs, result):
        if i is not None:
            if type(i) is not int:
                raise ProtocolError("output ids must be integers or null")
            if isinstance(v, torch.Tensor):
                s.tensors[i] = v
    if s.quota is not None:
        s.charge(label, outs)


def _layouts(raw: Any) -> tuple:
    """COMPILE's `layouts`: per output, [shape, stride, storage offset, storage bytes] or nil."""
    if type(raw) is not list:
        raise ProtocolError("COMPILE layouts must be an array")
    out = []
    for item in raw:
        if item is None:
            out.append(None)
            continue
        if (
            type(item) is not list
            or len(item) != 4
            or type(item[0]) is not list
            or type(item[1]) is not list
            or len(item[0]) != len(item[1])
            or not all(type(n) is int and n >= 0 for n in (*item[0], item[2], item[3]))
            or not all(type(n) is int for n in item[1])
        ):
            raise ProtocolError("a COMPILE layout is [shape, stride, offset, nbytes] or nil")
        out.append((tuple(item[0]), tuple(item[1]), item[2], item[3]))
    return tuple(out)


def _conform(v: Any, want: tuple) -> Any:
    """Output `v` laid out as the client traced it. The client builds views of a graph's outputs
    from the layouts of its trace; the server compiles the graph again for its own device, where
    Inductor (or a kernel such as a channels-last convolution's backward) may lay an output out
    otherwise, and every view would then read the wrong elements."""
    shape, stride, offset, nbytes = want
    if not isinstance(v, torch.Tensor) or tuple(v.shape) != shape:
        return v
    if v.storage_offset() == offset and all(
        n <= 1 or a == b for n, a, b in zip(shape, v.stride(), stride)
    ):
        return v
    size = max(nbytes // v.element_size(), 1)
    try:
        fixed = v.new_empty(size).as_strided(shape, stride, offset)
        fixed.copy_(v)
    except RuntimeError:  # a layout past its storage, or overlapping (an expanded output): the
        return v  # output stays as the server made it
    return fixed


def _run(s: SessionState, graph: graphs.Graph, inputs: list) -> Any:
    with torch.no_grad():
        if not graph.seeded:
            return graph.fn(*inputs)
        with rng.session_state(s.generator, s.device):
            return graph.fn(*inputs)
