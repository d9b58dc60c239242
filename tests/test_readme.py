"""The README's commands are the ones CI runs, and its quick-start demo works."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _bash_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_ci_runs_exactly_the_readme_test_command():
    test_cmd = next(b.strip() for b in _bash_blocks() if "pytest" in b)
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_cmd in ci


def test_readme_demo_runs_on_the_embedded_server():
    demo_cmd = next(b.strip() for b in _bash_blocks() if "rgpu.demo" in b)
    assert demo_cmd.endswith("python -m rgpu.demo")
    env = {k: v for k, v in os.environ.items() if k != "RGPU_SERVER"}
    out = subprocess.run(
        [sys.executable, "-m", "rgpu.demo"], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert "(x * 2).sum().item() = 8.0" in out.stdout
    assert "1000 ops then one .item() -> 16000.0" in out.stdout and "1 wait" in out.stdout
    assert "started an embedded rgpu server" in out.stderr
