"""Content-addressed uploads: bytes the server already holds for this session are not sent again.

Every test checks values against the CPU source and the exact bytes that went on the wire.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import rgpu
from rgpu.config import ConfigError

MB = 1 << 20


def test_a_repeated_batch_is_sent_once(counted):
    batch = torch.randn(256, 1024)  # 1 MiB: a chunked upload
    first = counted()
    xb = batch.to("rgpu")
    sent_first = counted()["bytes_out"] - first["bytes_out"]
    assert sent_first >= batch.numel() * 4
    for step in range(5):
        before = counted()
        xb = batch.to("rgpu")  # the previous xb is still alive while this runs
        after = counted()
        assert after["bytes_out"] - before["bytes_out"] < 200, f"step {step} re-sent the bytes"
        assert after["dedup_hits"] - before["dedup_hits"] == 1
        assert torch.equal(xb.cpu(), batch)
    assert counted()["dedup_bytes_saved"] - first["dedup_bytes_saved"] == 5 * batch.numel() * 4


def test_rerunning_a_cell_that_uploads_weights_sends_nothing_new(counted):
    torch.manual_seed(3)
    weights = {"w": torch.randn(128, 128), "b": torch.randn(4096)}
    model = {k: v.to("rgpu") for k, v in weights.items()}
    before = counted()
    model = {k: v.to("rgpu") for k, v in weights.items()}  # the same cell, run again
    after = counted()
    assert after["dedup_hits"] - before["dedup_hits"] == 2
    assert after["bytes_out"] - before["bytes_out"] < 400
    for k, v in weights.items():
        assert torch.equal(model[k].cpu(), v)


def test_a_changed_holder_is_not_used(counted):
    src = torch.arange(4096.0)
    held = src.to("rgpu")
    held.add_(1)  # the server's copy no longer has src's bytes
    before = counted()
    again = src.to("rgpu")
    assert counted()["dedup_hits"] == before["dedup_hits"]
    assert torch.equal(again.cpu(), src)
    view_changed = src.to("rgpu")  # remembered now; change it through a view
    view_changed[10:20].zero_()
    before = counted()
    third = src.to("rgpu")
    assert counted()["dedup_hits"] == before["dedup_hits"]
    assert torch.equal(third.cpu(), src)
    assert torch.equal(held.cpu(), src + 1)


def test_same_bytes_in_another_dtype_or_shape_are_sent(counted):
    src = torch.randn(64, 64)
    a = src.to("rgpu")
    before = counted()
    b = src.view(torch.int32).to("rgpu")  # the same bytes as int32
    c = src.reshape(4096).to("rgpu")
    assert counted()["dedup_hits"] == before["dedup_hits"]
    assert torch.equal(b.cpu(), src.view(torch.int32))
    assert torch.equal(c.cpu(), src.reshape(4096))
    assert torch.equal(a.cpu(), src)


def test_copy_into_an_existing_tensor_dedups_and_stays_exact(counted):
    src = torch.randn(2048)
    keep = src.to("rgpu")
    dst = torch.zeros(2048, device="rgpu")
    before = counted()
    dst.copy_(src)
    assert counted()["dedup_hits"] - before["dedup_hits"] == 1
    dst.mul_(2)  # dst changed after the copy: keep still holds src
    again = src.to("rgpu")
    assert torch.equal(again.cpu(), src)
    assert torch.equal(dst.cpu(), src * 2)
    del keep


def test_a_freed_holder_is_forgotten(counted):
    src = torch.randn(8192)
    held = src.to("rgpu")
    del held
    before = counted()
    fresh = src.to("rgpu")
    assert counted()["dedup_hits"] == before["dedup_hits"]
    assert torch.equal(fresh.cpu(), src)


def test_dedup_can_be_switched_off(server):
    code = textwrap.dedent(
        f"""
        import torch, rgpu
        rgpu.connect({server.url!r})
        src = torch.randn(256, 1024)
        a = src.to("rgpu"); b = src.to("rgpu")
        assert torch.equal(b.cpu(), src)
        s = rgpu.stats()
        assert s["dedup_hits"] == 0, s
        assert s["bytes_out"] > 2 * src.numel() * 4, s
        print("ok")
        """
    )
    env = dict(__import__("os").environ, RGPU_DEDUP="0")
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr


def test_a_bad_min_bytes_setting_is_a_clear_error_and_costs_nothing(dev, server, monkeypatch):
    # read at connect, like every RGPU_* setting: a clear error naming the variable, and the
    # session already open keeps working
    x = torch.arange(4.0, device=dev)
    monkeypatch.setenv("RGPU_DEDUP_MIN_BYTES", "lots")
    with pytest.raises(ConfigError, match=r"RGPU_DEDUP_MIN_BYTES='lots'.*whole number"):
        rgpu.connect(server.url)
    assert x.sum().item() == 6.0
    monkeypatch.delenv("RGPU_DEDUP_MIN_BYTES")
    rgpu.connect(server.url)
    src = torch.randn(64, 64)  # 16 kB, over the default 4 kB
    a, b = src.to("rgpu"), src.to("rgpu")
    assert torch.equal(b.cpu(), src) and torch.equal(a.cpu(), src)
    assert rgpu.stats()["dedup_hits"] == 1
