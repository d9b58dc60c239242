"""Expected-failure lists of the conformance tests: one `name: reason` per line, `#` comments."""

from __future__ import annotations

from pathlib import Path


def read_xfails(path: str | Path) -> dict[str, str]:
    out = {}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, reason = line.split(":", 1)
            out[name.strip()] = reason.strip()
    return out
