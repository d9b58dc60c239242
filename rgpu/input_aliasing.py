"""Graph inputs that share a server storage where Dynamo's fakes do not.

Dynamo sees that a view aliases its base (through `_base`), and AOTAutograd then refuses the
mutating graph of a tensor subclass, which runs as eager remote ops. Two inputs that share a
storage without being views of each other (`x` and `x.detach()`, state-dict tensors) are faked
as unrelated: a compiled graph that writes one and reads the other would read stale values.
Such graphs run eagerly too.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from . import storage_ids
from .tensor import TRACED, RemoteTensor


def _writes(gm: torch.fx.GraphModule) -> bool:
    """True when some op of Dynamo's graph writes a tensor in place (or into `out=`)."""
    for node in gm.graph.nodes:
        if node.op not in ("call_method", "call_function"):
            continue
        name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
        if (name.endswith("_") and not name.endswith("__")) or "out" in node.kwargs:
            return True
        schema = getattr(node.target, "_schema", None)
        if schema is not None and schema.is_mutable:
            return True
    return False


def unseen_aliasing(gm: torch.fx.GraphModule, example_inputs: list) -> bool:
    """True when two real inputs share a server storage, their fakes do not, and the graph
    writes in place."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    seen: dict[int, Any] = {}  # server storage address -> the fake storage of the first input
    hidden = False
    for node, real in zip(placeholders, example_inputs):
        if type(real) is not RemoteTensor or real._r is TRACED:
            continue
        fake = node.meta.get("example_value")
        fake_storage = fake.untyped_storage()._cdata if isinstance(fake, torch.Tensor) else None
        address = storage_ids.untyped_storage(real).data_ptr()
        if address in seen and (fake_storage is None or seen[address] != fake_storage):
            hidden = True
            break
        seen.setdefault(address, fake_storage)
    return hidden and _writes(gm)
