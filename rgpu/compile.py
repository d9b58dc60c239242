"""Graph shipping: `torch.compile(model, backend=rgpu.compile_backend(), dynamic=False)`.

Dynamo captures the model, AOTAutograd lowers it to aten forward and backward graphs over the
RemoteTensors' inner metas, and each graph is encoded once in rgpu's own format (no pickle) and
sent to the server, which rebuilds it as an FX graph and compiles it for its device (Inductor, or
plain eager execution of the graph with `compiler="eager"`). Every later call is one CALL message
that streams like any op. A graph the server cannot take (non-aten operators, constant tensors,
symbolic shapes) runs as eager remote ops instead, with one warning naming the reason.
"""

from __future__ import annotations

import hashlib
import logging
import operator
import warnings
from typing import Any

import torch
import torch.fx

from rgpu_protocol import (
    GRAPH_CONSTANT_BYTES,
    Encoder,
    HostData,
    Kind,
    NodeRef,
    NodeTag,
    ref_ext,
)

from . import current as _cur
from . import devices as _devices
from . import tensor as _tensor
from .input_aliasing import unseen_aliasing
from .tensor import Handle, RemoteTensor, key_of_meta, meta_of_key, wrap_inner

log = logging.getLogger("rgpu")
COMPILERS = ("inductor", "eager")
SHIPPED: list = []  # every graph this process compiled for shipping (tests count them)
_ENCODE = Encoder().encode
_warned: set[str] = set()


class Unshippable(Exception):
    """A graph rgpu cannot send; it runs as eager remote ops instead."""


def _encode_arg(x: Any, index: dict[torch.fx.Node, int]) -> Any:
    if isinstance(x, torch.fx.Node):
        return NodeRef(index[x])
    if isinstance(x, (list, tuple)):
        return [_encode_arg(y, index) for y in x]
    if isinstance(x, dict):
        return {k: _encode_arg(v, index) for k, v in x.items()}
    if isinstance(x, torch.device):
        # traced code ran on the meta device: those tensors belong on the server's device
        return x if x.type == "cpu" else torch.device(_tensor.DEVICE_TYPE)
    if isinstance(x, _SYMBOLIC):
        raise Unshippable("it has dynamic shapes; compile with dynamic=False")
    if isinstance(x, torch.Tensor):
        raise Unshippable("it holds a constant tensor")
    if x is None or type(x) in (
        bool,
        int,
        float,
        complex,
        str,
        torch.dtype,
        torch.layout,
        torch.memory_format,
    ):
        return x
    raise Unshippable(f"an argument of type {type(x).__name__} cannot be sent")


_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def serialize(gm: torch.fx.GraphModule) -> list:
    """The graph as rgpu's wire nodes (rgpu_protocol.NodeTag says what each holds)."""
    index: dict[torch.fx.Node, int] = {}
    nodes: list = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            nodes.append([NodeTag.PLACEHOLDER])
        elif node.op == "call_function" and node.target is operator.getitem:
            src, i = node.args
            if not isinstance(i, int):
                raise Unshippable("it indexes an output with a non-integer")
            nodes.append([NodeTag.GETITEM, index[src], i])
        elif node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            schema = node.target._schema
            ns, name = schema.name.split("::", 1)
            if ns != "aten":
                raise Unshippable(f"it calls {schema.name}, which is not an aten operator")
            op = f"{name}.{node.target._overloadname}"
            nodes.append(
                [
                    NodeTag.CALL,
                    op,
                    _encode_arg(list(node.args), index),
                    _encode_arg(dict(node.kwargs), index),
                ]
            )
        elif node.op == "get_attr":
            nodes.append([NodeTag.CONSTANT, _constant(gm, node.target)])
        elif node.op == "output":
            outs = node.args[0]
            outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
            nodes.append([NodeTag.OUTPUT, _encode_arg(outs, index)])
        elif isinstance(node.meta.get("val"), _SYMBOLIC):  # shape arithmetic: `s0 * s1`
            raise Unshippable("it has dynamic shapes; compile with dynamic=False")
        else:
            raise Unshippable(f"it has a {node.op} node ({node.target})")
        index[node] = len(index)
    for node in gm.graph.nodes:  # symbolic shapes in the outputs cannot be allocated ahead
        if node.op == "output":
            for v in _output_values(node):
                if isinstance(v, torch.Tensor) and any(
                    isinstance(s, torch.SymInt) for s in v.shape
                ):
                    raise Unshippable("its outputs have dynamic shapes; compile with dynamic=False")
    return nodes


def _constant(gm: torch.fx.GraphModule, name: str) -> HostData:
    """A constant the traced code made (`torch.tensor([...])`, an empty KV cache): small CPU
    tensors travel inside the graph; anything else keeps the graph from shipping."""
    value = gm
    for part in name.split("."):
        value = getattr(value, part)
    if not isinstance(value, torch.Tensor) or isinstance(value, RemoteTensor):
        raise Unshippable(f"it holds {name}, which is not a CPU tensor")
    if value.device.type != "cpu" or value.layout != torch.strided:
        raise Unshippable(f"it holds a constant tensor on {value.device} ({name})")
    nbytes = value.numel() * value.element_size()
    if nbytes > GRAPH_CONSTANT_BYTES:
        raise Unshippable(f"it holds a constant tensor of {nbytes} bytes ({name})")
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # compile_graph runs under the tracing fake mode
        data = value.detach().contiguous()
        raw = data.reshape(-1).view(torch.uint8).numpy().tobytes()
    return HostData(data.dtype, tuple(data.shape), raw)


def _output_values(output_node: torch.fx.Node) -> list:
    outs = output_node.args[0]
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    return [o.meta.get("val") if isinstance(o, torch.fx.Node) else o for o in outs]


def _output_plan(gm: torch.fx.GraphModule) -> list:
    """Per output: ("input", i) when the graph returns input i itself, ("new", key) for a fresh
    tensor, ("value", v) otherwise."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    outs = output_node.args[0]
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    plan = []
    for o in outs:
        if isinstance(o, torch.fx.Node) and o.op == "placeholder":
            plan.append(("input", placeholders.index(o)))
            continue
        val = o.meta.get("val") if isinstance(o, torch.fx.Node) else o
        if isinstance(val, torch.Tensor):
            plan.append(("new", key_of_meta(val)))
        else:
            plan.append(("value", val))
    return plan


class ShippedGraph:
    """The boxed callable AOTAutograd runs: one CALL message per call, outputs minted locally."""

    _boxed_call = True

    def __init__(
        self, key: str, nodes: list, compiler: str, mode: str | None, plan: list, n_nodes: int
    ) -> None:
        self._boxed_call = True  # in the instance dict: wrappers that copy __dict__ keep it
        self.key = key
        self.nodes = nodes
        self.compiler = compiler
        self.mode = mode
        self.plan = plan
        self.n_nodes = n_nodes

    def __call__(self, args: list) -> list:
        sess = _cur._current or _cur.current()
        dev, where = 0, None
        if _devices.MULTI:  # the graph runs on its first rgpu input's device (and server)
            first = next((h for a in args if (h := getattr(a, "_rgpu_handle", None))), None)
            dev = first.dev if first is not None else _devices.current()
            sess, where = _devices.session_of(dev, sess)
        if self.key not in sess.graphs:  # once per session: the server builds (or finds) it
            layouts = [[list(p[1]), list(p[2]), p[3], p[4]] if k == "new" else None
                       for k, p in self.plan]  # fmt: skip
            sess.post((Kind.COMPILE, self.key, self.nodes, self.compiler, self.mode, layouts))
            sess.graphs.add(self.key)
        refs = []
        handles = []  # held until the CALL is queued: an input freed earlier would reach the
        for a in args:  # server (as a FREE) before the CALL that reads it
            if isinstance(a, torch.Tensor):
                # a RemoteTensor itself where AOTAutograd passes a graph's output on as it is
                # (saved for the backward graph)
                handle = a._r if type(a) is RemoteTensor else getattr(a, "_rgpu_handle", None)
                if handle is not None:
                    refs.append(handle.ext)
                    handles.append(handle)
                elif a.device.type == "cpu":
                    refs.append(a)  # a CPU tensor the graph captured: sent along, inline
                elif a.device.type == "meta":  # from no RemoteTensor of ours
                    raise RuntimeError(
                        "a compiled rgpu graph got a meta tensor: either an input or parameter "
                        "is on the meta device (move it to rgpu before calling the compiled "
                        "model), or, in a backward, the gradient of an output the compiled code "
                        "made itself (torch.zeros(..., device=x.device)) came in another layout "
                        "than traced: return that output contiguous (.contiguous())"
                    )
                else:
                    raise RuntimeError(
                        f"a compiled rgpu graph got a {a.device.type} tensor; move every input "
                        "and parameter to rgpu before calling the compiled model"
                    )
            else:
                refs.append(a)
        args.clear()  # boxed convention: let go of inputs as early as possible
        outs: list = []
        ids: list = []
        for kind, payload in self.plan:
            if kind == "new":
                m = meta_of_key(payload)
                h = Handle(sess, _tensor.next_id(), payload, None, dev)
                m._rgpu_handle = h
                # a RemoteTensor, not its meta: AOTAutograd hands some outputs back as they are
                # (see RemoteTensor.__tensor_unflatten__)
                outs.append(wrap_inner(m))
                ids.append(h.id)
            elif kind == "input":
                outs.append(None)  # filled below
                ids.append(None)
            else:
                outs.append(payload)
                ids.append(None)
        sess.post((Kind.CALL, self.key, refs, ids), device=where)
        # a whole graph of work: the server starts on it now, while this thread goes on (the
        # quiet flush waits for a pause in the client's messages, which may not come before the
        # next wait; that made a compiled training step client time plus server time)
        sess.send_queued()
        del handles
        return outs


class _InputOutputs:
    """Wraps a ShippedGraph whose outputs include some of its inputs (returned as they are)."""

    _boxed_call = True

    def __init__(self, graph: ShippedGraph) -> None:
        self._boxed_call = True
        self.graph = graph
        self.positions = [
            (k, payload) for k, (kind, payload) in enumerate(graph.plan) if kind == "input"
        ]

    def __call__(self, args: list) -> list:
        kept = {i: args[i] for _, i in self.positions}
        outs = self.graph(args)
        for k, i in self.positions:
            outs[k] = kept[i]
        return outs


class _OnRgpu(torch.fx.Interpreter):
    """Runs a traced graph with RemoteTensors: tensors it creates go to rgpu, not to meta."""

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        def fix(x: Any) -> Any:
            if isinstance(x, torch.device) and x.type == "meta":
                return _tensor.DEVICE
            return x

        return super().call_function(
            target,
            torch.utils._pytree.tree_map(fix, args),
            torch.utils._pytree.tree_map(fix, kwargs),
        )


class EagerFallback:
    """Runs a graph the server cannot take as ordinary remote ops (one message per op)."""

    _boxed_call = True

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        self._boxed_call = True
        self.gm = gm

    def __call__(self, args: list) -> list:
        wrapped = [
            wrap_inner(a) if isinstance(a, torch.Tensor) and hasattr(a, "_rgpu_handle") else a
            for a in args
        ]
        args.clear()
        outs = _OnRgpu(self.gm).run(*wrapped)
        return list(outs) if isinstance(outs, (list, tuple)) else [outs]


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(
            f"rgpu: running a compiled graph as eager remote ops because {reason}", stacklevel=3
        )


def _graph_compiler(compiler: str, mode: str | None):
    def compile_graph(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        try:
            nodes = serialize(gm)
            plan = _output_plan(gm)
        except Unshippable as e:
            _warn_once(str(e))
            return EagerFallback(gm)
        blob = _ENCODE([nodes, compiler, mode])
        key = hashlib.sha256(blob).hexdigest()
        graph = ShippedGraph(key, nodes, compiler, mode, plan, len(gm.graph.nodes))
        SHIPPED.append(graph)
        return _InputOutputs(graph) if any(k == "input" for k, _ in plan) else graph

    return compile_graph


def compile_backend(compiler: str = "inductor", mode: str | None = None) -> Any:
    """A torch.compile backend that ships whole graphs to the rgpu server.

        model = torch.compile(model, backend=rgpu.compile_backend(), dynamic=False)

    `compiler="inductor"` compiles each graph with Inductor on the server (for its GPU);
    `compiler="eager"` runs the shipped graph op by op there (fast to start; for diagnosis).
    `mode` is passed to the server's torch.compile (e.g. "reduce-overhead", "max-autotune").
    """
    if compiler not in COMPILERS:
        raise ValueError(f"compiler must be one of {COMPILERS}, not {compiler!r}")
    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    fn = _graph_compiler(compiler, mode)
    aot = aot_autograd(
        fw_compiler=fn, bw_compiler=fn, partition_fn=min_cut_rematerialization_partition
    )

    def backend(gm: torch.fx.GraphModule, example_inputs: list, **kwargs: Any) -> Any:
        if not _touches_rgpu(gm, example_inputs):
            return gm  # a graph of CPU tensors: its results stay on the CPU, as eager gives them
        if unseen_aliasing(gm, example_inputs):
            _warn_once(
                "two of its inputs share a storage without being views of one another (x and "
                "x.detach()), which the compiled graph would not see"
            )
            return gm
        try:
            return aot(gm, example_inputs, **kwargs)
        except Exception as e:
            # AOTAutograd refuses some graphs of subclass inputs (inputs that alias one another
            # and are mutated): Dynamo's graph, run as eager remote ops, keeps their semantics
            _warn_once(f"AOTAutograd could not trace it ({_first_sentence(e)})")
            return gm

    return backend


def _touches_rgpu(gm: torch.fx.GraphModule, example_inputs: list) -> bool:
    """Whether a graph reads an rgpu tensor or makes one (`torch.zeros(n, device="rgpu")`)."""
    for x in example_inputs:
        if isinstance(x, torch.Tensor) and x.device.type == _tensor.DEVICE_TYPE:
            return True
    for node in gm.graph.nodes:
        values = [node.meta.get("example_value"), *node.args, *node.kwargs.values()]
        for v in torch.utils._pytree.tree_leaves(values):
            if isinstance(v, (str, torch.device)) and str(v).startswith(_tensor.DEVICE_TYPE):
                return True
            if isinstance(v, torch.Tensor) and v.device.type == _tensor.DEVICE_TYPE:
                return True
    return False


def _first_sentence(e: Exception) -> str:
    """The first sentence of `e`, on one line."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text.split('. ')[0][:240]}"


def _mode_of(config_patches: dict | None) -> str | None:
    """The `torch.compile(mode=...)` behind the Inductor options torch passes its default backend
    (`torch._inductor.list_mode_options`); other options stay on this machine."""
    patches = config_patches or {}
    autotune, graphs = patches.get("max_autotune"), patches.get("triton.cudagraphs")
    if autotune:
        return "max-autotune" if graphs else "max-autotune-no-cudagraphs"
    return "reduce-overhead" if graphs else None


def _ship_default_backend() -> None:
    """`torch.compile(model)` on rgpu tensors compiles for the rgpu device, as it compiles for a
    CUDA tensor's GPU: the default backend's graphs with rgpu inputs are shipped and compiled by
    Inductor on the server (`compile_backend()`, with the `mode` given). Run here, Inductor would
    generate code for this machine, which cannot run rgpu tensors."""
    import torch._inductor.compile_fx as inductor

    compile_fx = inductor.compile_fx  # what torch.compile's default backend calls

    def shipping(gm: torch.fx.GraphModule, example_inputs: list, *args: Any, **kwargs: Any) -> Any:
        for x in example_inputs:
            if isinstance(x, RemoteTensor) or getattr(x, "device", None) == _tensor.DEVICE:
                mode = _mode_of(kwargs.get("config_patches"))
                return compile_backend(mode=mode)(gm, example_inputs)
        return compile_fx(gm, example_inputs, *args, **kwargs)

    inductor.compile_fx = shipping


_shipping = False


def ship_default_backend_graphs() -> None:
    """Called when torch.compile first traces a RemoteTensor (Dynamo is loaded by then); importing
    rgpu itself never imports Dynamo. backend="rgpu" comes from the package's entry point."""
    global _shipping
    if not _shipping:
        _shipping = True
        try:
            _ship_default_backend()
        except Exception:  # a torch without this layout: backend="rgpu" still works
            pass


def rgpu_backend(gm: torch.fx.GraphModule, example_inputs: list, **kwargs: Any) -> Any:
    """backend="rgpu" (registered through the torch_dynamo_backends entry point)."""
    return compile_backend()(gm, example_inputs, **kwargs)


__all__ = ["compile_backend", "serialize", "Unshippable", "ref_ext"]
