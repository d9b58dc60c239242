"""Graph inputs that share a server storage where Dynamo's fakes do not.

Dynamo sees that a view aliases its base (through `_base`), and AOTAutograd then refuses the
mutating graph of a tensor subclass, which runs as eager remote ops. Two inputs that share a
storage without being views of each other (`x` and `x.detach()`, state-dict tensors) are faked
as unrelated: a compiled graph that writes one and reads the other would read stale values.
Graphs with such inputs run eagerly too.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from . import storage_ids
from .tensor import TRACED, RemoteTensor


def unseen_aliasing(gm: torch.fx.GraphModule, example_inputs: list) -> bool:
    """True when two real inputs share a server storage and their fakes do not. Whether the graph
    writes one is not asked: Dynamo records writes as `operator.iadd`, `operator.setitem`, ...
    as well as in-place methods, and a list of them missed some (a stale read, no error)."""
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
    return hidden
