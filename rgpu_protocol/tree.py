"""Nested containers on the wire: state dicts, optimizer states, anything `torch.save` stores
with `weights_only=True` rules.

msgpack maps take only string keys, and msgpack has no tuple, so every container travels tagged:
``["\\0d", [k1, v1, k2, v2, ...]]`` for a dict (any keys msgpack can carry: str, int, float,
bool, None), ``["\\0l", [...]]`` for a list, ``["\\0t", [...]]`` for a tuple. Leaves are what
msgpack and the codec carry (numbers, str, bytes, None, dtypes, devices, tensor references or
metadata); `leaf` maps tensors to and from them at each end.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .errors import ProtocolError

DICT = "\0d"
LIST = "\0l"
TUPLE = "\0t"
_TAGS = {DICT, LIST, TUPLE}
MAX_ITEMS = 1 << 20  # leaves and containers in one tree


def pack(obj: Any, leaf: Callable[[Any], Any]) -> Any:
    """The wire form of `obj`; `leaf(x)` gives each non-container value's (it may raise)."""
    count = [0]

    def walk(x: Any) -> Any:
        count[0] += 1
        if count[0] > MAX_ITEMS:
            raise ProtocolError(f"a tree of more than {MAX_ITEMS} items")
        t = type(x)
        if isinstance(x, dict):
            flat: list = []
            for k, v in x.items():
                if type(k) not in (str, int, float, bool) and k is not None:
                    raise ProtocolError(f"a dict key of type {type(k).__name__} cannot be sent")
                flat.append(k)
                flat.append(walk(v))
            return [DICT, flat]
        if t is list:
            return [LIST, [walk(y) for y in x]]
        if isinstance(x, tuple) and not hasattr(x, "_fields"):  # torch.Size too; not namedtuples
            return [TUPLE, [walk(y) for y in x]]
        return leaf(x)

    return walk(obj)


def unpack(wire: Any, leaf: Callable[[Any], Any]) -> Any:
    """The tree `pack` made; `leaf(x)` turns each leaf back (a tensor reference into a tensor)."""

    def walk(x: Any) -> Any:
        if type(x) is list and len(x) == 2 and type(x[0]) is str and x[0] in _TAGS:
            tag, items = x
            if type(items) is not list:
                raise ProtocolError("a tree container must hold a list")
            if tag == DICT:
                if len(items) % 2:
                    raise ProtocolError("a tree dict must hold key, value pairs")
                out = {}
                for i in range(0, len(items), 2):
                    key = items[i]
                    if type(key) not in (str, int, float, bool) and key is not None:
                        raise ProtocolError("a tree dict key must be a str, number, bool or None")
                    out[key] = walk(items[i + 1])
                return out
            values = [walk(y) for y in items]
            return values if tag == LIST else tuple(values)
        if type(x) is list:
            raise ProtocolError("a list in a tree must be tagged")
        return leaf(x)

    return walk(wire)


def leaves(wire: Any) -> list:
    """Every leaf of a packed tree, in order."""
    found: list = []

    def walk(x: Any) -> None:
        if type(x) is list and len(x) == 2 and type(x[0]) is str and x[0] in _TAGS:
            items = x[1]
            if x[0] == DICT:
                for i in range(1, len(items), 2):
                    walk(items[i])
            else:
                for y in items:
                    walk(y)
        else:
            found.append(x)

    walk(wire)
    return found


def map_leaves(wire: Any, fn: Callable[[Any], Any]) -> Any:
    """A packed tree with every leaf replaced by `fn(leaf)`, in order (containers as they are)."""

    def walk(x: Any) -> Any:
        if type(x) is list and len(x) == 2 and type(x[0]) is str and x[0] in _TAGS:
            tag, items = x
            if tag == DICT:
                return [tag, [items[i] if i % 2 == 0 else walk(v) for i, v in enumerate(items)]]
            return [tag, [walk(y) for y in items]]
        return fn(x)

    return walk(wire)
