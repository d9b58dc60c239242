"""Adapting a library module right after the user's program imports it (rgpu imports none of
its optional libraries itself: transformers alone takes seconds)."""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable
from typing import Any


def after_import(name: str, patch: Callable[[Any], Any]) -> None:
    """`patch(module)` now if module `name` is loaded, else as soon as it is."""
    module = sys.modules.get(name)
    if module is not None:
        patch(module)
    elif not any(isinstance(f, _AfterImport) and (f.name, f.patch) == (name, patch)
                 for f in sys.meta_path):  # fmt: skip
        sys.meta_path.insert(0, _AfterImport(name, patch))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader the other finders give `name` with `patch`."""

    def __init__(self, name: str, patch: Callable[[Any], Any]) -> None:
        self.name, self.patch = name, patch

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != self.name:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run, patch = loader.exec_module, self.patch

        def exec_module(module: Any) -> None:
            run(module)
            if module.__name__ == name:
                patch(module)

        loader.exec_module = exec_module
        return spec
