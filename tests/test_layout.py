"""The shape of the code: imports go one way, the protocol does no I/O, modules stay small.

Read from the source (every import statement, inside functions and `if TYPE_CHECKING:` blocks
included), so a cycle cannot hide behind a late import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {
    "rgpu": ROOT / "rgpu",
    "rgpu_protocol": ROOT / "rgpu_protocol",
    "rgpu_server": ROOT / "server" / "rgpu_server",
    "rgpu_jupyter": ROOT / "rgpu_jupyter",
}
MAX_LINES = 450
IO_MODULES = {"socket", "ssl", "threading", "_thread", "asyncio", "selectors", "subprocess",
              "concurrent", "multiprocessing", "websockets", "time"}  # fmt: skip


def _modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            found[name] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Every module `name` imports, as absolute names (top-level packages for outside ones)."""
    package = name if path.stem == "__init__" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            submodules = {f"{target}.{a.name}" for a in node.names} & set(MODULES)
            out.update(submodules)  # `from . import x` imports module x
            if node.module or len(submodules) < len(node.names):
                out.add(target)
    return {m for m in out if m}


GRAPH = {name: _imports(name, path) & set(MODULES) - {name} for name, path in MODULES.items()}


def _cycle() -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(GRAPH[n]):
            if state.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(GRAPH):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_there_is_no_import_cycle():
    assert _cycle() is None, " -> ".join(_cycle() or [])


def test_the_protocol_imports_no_io_and_neither_end():
    for name, path in MODULES.items():
        if name.split(".")[0] != "rgpu_protocol":
            continue
        imported = {m.split(".")[0] for m in _imports(name, path)}
        assert not imported & IO_MODULES, f"{name} imports {imported & IO_MODULES}"
        assert not imported & {"rgpu", "rgpu_server", "rgpu_jupyter"}, name


def test_the_server_never_imports_the_client():
    for name, path in MODULES.items():
        if name.split(".")[0] == "rgpu_server":
            imported = {m.split(".")[0] for m in _imports(name, path)}
            assert "rgpu" not in imported and "rgpu_jupyter" not in imported, name


def test_the_jupyter_extension_uses_the_client_package_only_through_rgpu():
    for name, path in MODULES.items():
        if name.split(".")[0] == "rgpu_jupyter":
            imported = _imports(name, path)
            assert not {m for m in imported if m.startswith("rgpu_server")}, name


@pytest.mark.parametrize("name", sorted(MODULES))
def test_modules_stay_small(name):
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines; split it by concern"
