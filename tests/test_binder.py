"""Binder's configuration: `binder/start` starts a CPU server and a notebook runs against it."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BINDER = ROOT / "binder"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_requirements_pin_a_cpu_torch_and_install_this_repo_with_its_jupyter_extra():
    lines = [ln.strip() for ln in (BINDER / "requirements.txt").read_text().splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith("#")]
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in lines
    assert "torch==2.13.0" in lines
    assert ".[jupyter]" in lines
    assert not (ROOT / ".binder").exists()  # repo2docker refuses both folders


def test_start_ends_by_exec_ing_its_arguments():
    text = (BINDER / "start").read_text()
    assert text.startswith("#!/bin/bash")
    assert text.rstrip().endswith('exec "$@"')
    assert os.access(BINDER / "start", os.X_OK)


def test_start_runs_a_notebook_against_the_server_it_started(tmp_path):
    port = _free_port()
    # as on mybinder.org: no token or server configured; `start` must provide both
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RGPU_SERVER", "RGPU_LOCAL_DEVICE", "RGPU_TOKEN")
    }
    env.update(
        RGPU_BINDER_PORT=str(port),
        RGPU_BINDER_LOG=str(tmp_path / "server.log"),
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
    )
    cmd = [
        str(BINDER / "start"),
        sys.executable, "-m", "nbconvert", "--to", "notebook", "--execute",
        "--output-dir", str(tmp_path), str(ROOT / "notebooks" / "01_quickstart.ipynb"),
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        # the background server is in the start script's process group; end them together
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, err[-3000:]
    nb = json.loads((tmp_path / "01_quickstart.ipynb").read_text())
    outputs = [o for c in nb["cells"] if c["cell_type"] == "code" for o in c["outputs"]]
    text = "".join("".join(o.get("text", "")) for o in outputs)
    assert f"rgpu: connected to ws://127.0.0.1:{port}, cpu" in text
    assert "started an embedded rgpu server" not in text  # it used Binder's server, not its own
    assert not [o for o in outputs if o["output_type"] == "error"]
    assert re.search(r"^rgpu: 10\d messages, 1 wait, ", text, re.M)  # the 100-op loop, read once
