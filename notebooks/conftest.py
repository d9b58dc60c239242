"""The notebooks are tests: `python -m pytest` from the repo root checks them with nbval.

pyproject's `testpaths` includes this folder. When pytest reaches it, this file turns on nbval's
full output comparison (unless `--nbval-lax` was given), runs the kernels in the current
environment (no kernelspec to install), and sanitizes with `sanitize.cfg`; it is the same as

    pytest --nbval notebooks/ --nbval-current-env --nbval-sanitize-with notebooks/sanitize.cfg

The stored outputs come from the embedded CPU server, so for a comparison the kernels ignore
`RGPU_SERVER` and run the embedded server on the CPU, whatever this machine has.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_configure(config: pytest.Config) -> None:
    opt = config.option
    if not getattr(opt, "nbval_lax", False):
        opt.nbval = True
    opt.nbval_current_env = True
    if not opt.nbval_sanitize_with:
        opt.nbval_sanitize_with = str(HERE / "sanitize.cfg")
    if opt.nbval:
        # stderr is compared too: on a fresh machine matplotlib's first import would print
        # "Matplotlib is building the font cache" into the plotting cell, so build it here
        import matplotlib.font_manager  # noqa: F401


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before a notebook's kernel starts: the environment its stored outputs came from."""
    if item.path.suffix == ".ipynb" and item.config.option.nbval:
        os.environ.pop("RGPU_SERVER", None)
        os.environ.pop("RGPU_CHECK_META", None)  # it adds bytes to every message
        os.environ["RGPU_LOCAL_DEVICE"] = "cpu"
        # byte counts are compared: op-stream compression turns on when the link is measured
        # slow, which a loaded machine's loopback can be; the stored outputs are uncompressed
        os.environ["RGPU_COMPRESS"] = "0"
