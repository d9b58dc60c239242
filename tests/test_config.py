"""One configuration object for every RGPU_* setting of the client, read at connect."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import rgpu
from rgpu.config import DEFAULT, FIELDS, Config, ConfigError, table

ROOT = Path(__file__).resolve().parent.parent


def test_the_configuration_docs_list_every_setting():
    docs = (ROOT / "docs" / "configuration.md").read_text()
    assert table() in docs
    assert set(FIELDS) == set(DEFAULT.describe()) | {"token"}


def test_every_variable_is_read_and_unset_ones_keep_their_defaults():
    env = {
        "RGPU_SERVER": "ws://gpu:1",
        "RGPU_FLUSH_OPS": "7",
        "RGPU_RECONNECT_SECONDS": "2.5",
        "RGPU_LANE": "off",
        "RGPU_COMPRESS": "always",
        "RGPU_CHECK_META": "yes",
        "RGPU_PROXY": "  ",  # blank means unset
    }
    c = Config.from_env(env)
    assert (c.server, c.flush_ops, c.reconnect_seconds, c.lane, c.compress, c.check_meta) == (
        "ws://gpu:1", 7, 2.5, False, "on", True,
    )  # fmt: skip
    assert c.proxy is None and c.flush_bytes == DEFAULT.flush_bytes
    assert Config.from_env({}) == DEFAULT


@pytest.mark.parametrize(
    ("variable", "value", "says"),
    [
        ("RGPU_FLUSH_OPS", "many", "whole number"),
        ("RGPU_FLUSH_OPS", "0", "at least 1"),
        ("RGPU_LANE_MIN_BYTES", "-1", "at least 0"),
        ("RGPU_RECONNECT_SECONDS", "soon", "number of seconds"),
        ("RGPU_LANE", "maybe", "1 or 0"),
        ("RGPU_COMPRESS", "sometimes", "auto"),
    ],
)
def test_a_bad_value_is_one_error_naming_the_variable(variable, value, says):
    with pytest.raises(ConfigError, match=rf"^{variable}='{value}' is not understood: .*{says}"):
        Config.from_env({variable: value})


def test_the_environment_is_read_at_connect_and_kept_by_the_session(dev, server, monkeypatch):
    monkeypatch.setenv("RGPU_FLUSH_OPS", "3")
    session = rgpu.connect(server.url)
    monkeypatch.setenv("RGPU_FLUSH_OPS", "5000")  # read at the next connect, not now
    assert session.config.flush_ops == 3 and session.stream.flush_ops == 3
    x = torch.ones(4, device=dev) + 1
    # the first op may wait for rgpu's background imports: long enough for a quiet-time flush
    torch.rgpu.synchronize()
    frames = session.stats()["frames"]
    for _ in range(6):
        x = x + 1
    assert session.stats()["frames"] - frames == 2  # six ops, three to a batch
    assert x.sum().item() == 32.0
    assert rgpu.connect(server.url).config.flush_ops == 5000
