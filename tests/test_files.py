"""Files on the GPU host: real files in a real server's data directories (`--data-dir`).

Values are checked against what local torch, safetensors and numpy read from the same files;
every refusal is checked for its message and for a session that goes on working.
"""

from __future__ import annotations

import json
import os
import stat

import numpy as np
import pytest
import torch
from rgpu_test_servers import ServerProcess
from safetensors.torch import load_file as st_load
from safetensors.torch import save_file as st_save

import rgpu
import rgpu.files as rf


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    base = tmp_path_factory.mktemp("data")
    data, ro, ckpt = base / "data", base / "datasets", base / "ckpt"
    for d in (data, ro, ckpt):
        d.mkdir()
    srv = ServerProcess(
        "--data-dir", str(data), "--data-dir", f"{ro}:ro", "--data-dir", f"ckpt={ckpt}"
    )
    yield srv, data, ro, ckpt
    rgpu.disconnect()
    srv.stop()


@pytest.fixture
def files(roots):
    srv, data, ro, ckpt = roots
    rgpu.connect(srv.url)
    yield data, ro, ckpt


def _wire() -> int:
    s = rgpu.stats()
    return s["bytes_in"] + s["bytes_out"]


def test_a_safetensors_file_loads_on_the_server_and_only_metadata_crosses(files):
    data, _, _ = files
    tensors = {
        "w": torch.randn(256, 256),
        "b": torch.arange(7, dtype=torch.int64),
        "h": torch.randn(3, 5, dtype=torch.bfloat16),
        "flag": torch.tensor([True, False]),
    }
    st_save(tensors, data / "m.safetensors", metadata={"format": "pt"})
    before = _wire()
    loaded = rf.load_file("m.safetensors")
    assert _wire() - before < 2048  # 270 kB of tensors; under 2 kB on the wire
    assert set(loaded) == set(tensors)
    for name, t in tensors.items():
        got = loaded[name]
        assert got.device.type == "rgpu" and got.dtype == t.dtype and got.shape == t.shape
        assert torch.equal(got.cpu(), t)
    assert rf.safetensors_metadata("m.safetensors") == {"format": "pt"}
    half = rf.load_file("m.safetensors", dtype=torch.float16)
    assert half["w"].dtype == torch.float16 and half["b"].dtype == torch.int64  # ints stay ints
    assert torch.equal(half["w"].cpu(), tensors["w"].half())


def test_tensors_loaded_from_a_file_are_the_sessions_own(files):
    data, _, _ = files
    st_save({"x": torch.zeros(4)}, data / "z.safetensors")
    x = rf.load_file("z.safetensors")["x"]
    x.add_(1)  # changes the tensor on the server, never the file
    assert torch.equal(x.cpu(), torch.ones(4))
    assert torch.equal(st_load(data / "z.safetensors")["x"], torch.zeros(4))
    assert torch.equal(rf.load_file("z.safetensors")["x"].cpu(), torch.zeros(4))


def test_save_file_writes_a_file_local_safetensors_reads(files):
    data, _, ckpt = files
    x = torch.randn(64, 32, device="rgpu")
    w = {"x": x, "y": x.t().contiguous() * 2, "cpu": torch.arange(3.0)}
    before = _wire()
    size = rf.save_file(w, "ckpt:run/out.safetensors", metadata={"step": "10"})
    assert _wire() - before < 2048 + 12 + 64  # the CPU tensor (12 bytes) is uploaded, not x
    back = st_load(ckpt / "run" / "out.safetensors")
    assert size == os.path.getsize(ckpt / "run" / "out.safetensors")
    assert torch.equal(back["x"], x.cpu()) and torch.equal(back["y"], x.cpu().t() * 2)
    assert torch.equal(back["cpu"], torch.arange(3.0))
    assert not [p for p in (ckpt / "run").iterdir() if p.name.startswith(".")]  # no partial left
    with pytest.raises(rf.FileError, match="same tensor"):
        rf.save_file({"a": x, "b": x}, "tied.safetensors")


def test_a_sharded_checkpoint_loads_as_one_dict(files):
    data, _, _ = files
    shard = data / "sharded"
    shard.mkdir()
    parts = {
        "a.safetensors": {"l0.w": torch.randn(4, 4)},
        "b.safetensors": {"l1.w": torch.randn(2)},
    }
    weight_map = {}
    for name, tensors in parts.items():
        st_save(tensors, shard / name)
        weight_map.update(dict.fromkeys(tensors, name))
    (shard / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 72}, "weight_map": weight_map})
    )
    loaded = rf.load_file("sharded/model.safetensors.index.json")
    assert set(loaded) == {"l0.w", "l1.w"}
    assert torch.equal(loaded["l0.w"].cpu(), parts["a.safetensors"]["l0.w"])
    (shard / "b.safetensors").unlink()
    with pytest.raises(rf.FileError, match="names the shard 'b.safetensors', which is missing"):
        rf.load_file("sharded/model.safetensors.index.json")


def _train(model, opt, batches):
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_a_model_and_its_optimizer_saved_mid_training_resume_with_the_cpu_runs_losses(files):
    data, _, _ = files
    torch.manual_seed(0)
    cpu_model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    batches = [(torch.randn(32, 8), torch.randn(32, 1)) for _ in range(8)]
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    model.load_state_dict(cpu_model.state_dict())
    cpu_opt = torch.optim.Adam(cpu_model.parameters(), lr=1e-2)
    expected = _train(cpu_model, cpu_opt, batches)
    model.to("rgpu")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    remote = [(x.to("rgpu"), y.to("rgpu")) for x, y in batches]
    first = _train(model, opt, remote[:4])
    rf.save({"model": model.state_dict(), "opt": opt.state_dict(), "epoch": 1}, "ck/state.pt")
    on_disk = torch.load(data / "ck" / "state.pt", weights_only=True)  # loads anywhere, no rgpu
    assert on_disk["epoch"] == 1 and on_disk["model"]["0.weight"].device.type == "cpu"
    # a fresh model and optimizer, restored from the server's file
    torch.manual_seed(123)
    model2 = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    model2.to("rgpu")
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-2)
    state = rf.load("ck/state.pt")
    assert state["epoch"] == 1 and state["model"]["0.weight"].device.type == "rgpu"
    model2.load_state_dict(state["model"])
    opt2.load_state_dict(state["opt"])
    second = _train(model2, opt2, remote[4:])
    assert first + second == pytest.approx(expected, rel=1e-5, abs=1e-7)


def test_from_file_cuts_batches_on_the_server_like_numpy(files):
    data, _, _ = files
    tokens = np.random.default_rng(0).integers(0, 50000, size=10_000, dtype=np.uint16)
    tokens.tofile(data / "train.bin")
    before = _wire()
    t = rf.from_file("train.bin", torch.uint16)
    assert _wire() - before < 1024 and t.shape == (10_000,) and t.dtype == torch.uint16
    starts = [0, 17, 4000, 9000]
    x = torch.stack([t[i : i + 64].to(torch.int64) for i in starts])
    assert np.array_equal(
        x.cpu().numpy(), np.stack([tokens[i : i + 64].astype(np.int64) for i in starts])
    )
    part = rf.from_file("train.bin", torch.uint16, shape=(10, 10), offset=200)
    assert np.array_equal(part.cpu().numpy(), tokens[100:200].reshape(10, 10))
    arr = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    np.save(data / "a.npy", arr)
    assert np.array_equal(rf.from_file("a.npy").cpu().numpy(), arr)
    with pytest.raises(rf.FileError, match="not a whole number of torch.int32"):
        rf.from_file("train.bin", torch.int32, offset=2)


def test_listdir_stat_and_remove(files):
    data, _, _ = files
    (data / "dir").mkdir(exist_ok=True)
    (data / "dir" / "a.txt").write_text("hello")
    assert "a.txt" in rf.listdir("dir")
    st = rf.stat("dir/a.txt")
    assert (st.size, st.is_dir) == (5, False) and rf.stat("dir").is_dir
    rf.remove("dir/a.txt")
    assert not (data / "dir" / "a.txt").exists()
    with pytest.raises(rf.FileError, match="no file"):
        rf.stat("dir/a.txt")


def test_upload_and_download_skip_what_the_other_side_has_and_continue_where_they_stopped(
    files, tmp_path
):
    data, _, _ = files
    local = tmp_path / "corpus"
    local.mkdir()
    big = os.urandom(9 << 20)
    (local / "big.bin").write_bytes(big)
    (local / "sub").mkdir()
    (local / "sub" / "small.txt").write_text("x" * 100)
    assert rf.upload(local, "corpus") == len(big) + 100
    assert (data / "corpus" / "big.bin").read_bytes() == big
    assert rf.upload(local, "corpus") == 0  # the same SHA-256 on the server: nothing sent
    # an upload cut short: the server holds its first 5 MiB; the next upload sends the rest
    sess = rgpu.current_session()
    from rgpu_protocol import Kind

    sess.post((Kind.WRITE_BYTES, "again.bin", 0, big[: 5 << 20]))
    out = rgpu.stats()["bytes_out"]
    assert rf.upload(local / "big.bin", "again.bin") == len(big) - (5 << 20)
    assert rgpu.stats()["bytes_out"] - out < len(big) - (4 << 20)
    assert (data / "again.bin").read_bytes() == big
    # downloads: whole folders, then a cut-short one that continues
    back = tmp_path / "back"
    assert rf.download("corpus", back) == len(big) + 100
    assert (back / "big.bin").read_bytes() == big and (
        back / "sub" / "small.txt"
    ).read_text() == "x" * 100
    assert rf.download("corpus", back) == 0
    (back / "big.bin").unlink()
    (back / "big.bin.rgpu-partial").write_bytes(big[:3000])
    assert rf.download("corpus/big.bin", back / "big.bin") == len(big) - 3000
    assert (back / "big.bin").read_bytes() == big


def _refused(call, message):
    x = torch.arange(3.0, device="rgpu")
    with pytest.raises(rf.FileError, match=message):
        call()
    assert (x * 2).sum().item() == 6.0  # the session goes on


def test_every_refusal_names_the_problem_and_the_session_goes_on(files):
    data, ro, _ = files
    (ro / "set.bin").write_bytes(bytes(8))
    os.symlink("/etc", data / "etc")
    os.mkfifo(data / "fifo")
    _refused(lambda: rf.load_file("../x"), "climbs out with '..'")
    _refused(lambda: rf.load_file("/etc/passwd"), "is absolute")
    _refused(
        lambda: rf.load_file("etc/passwd"),
        "leads out of the data directory 'data' through a symbolic link",
    )
    _refused(lambda: rf.from_file("fifo", torch.uint8), "not a regular file")
    _refused(lambda: rf.load_file("nope:x"), "no data directory named 'nope'.*data, datasets, ckpt")
    _refused(lambda: rf.load_file("missing.safetensors"), "no file 'missing.safetensors'")
    _refused(lambda: rf.save_file({"a": torch.ones(2)}, "datasets:out.safetensors"), "read-only")
    assert np.array_equal(rf.from_file("datasets:set.bin", torch.uint8).cpu().numpy(), np.zeros(8))
    if os.geteuid() == 0:  # a device node inside the root (only root may make one)
        os.mknod(data / "null", stat.S_IFCHR | 0o600, os.makedev(1, 3))
        _refused(lambda: rf.from_file("null", torch.uint8), "not a regular file")


def test_a_corrupted_or_truncated_file_is_a_clear_error_and_creates_nothing(files):
    data, _, _ = files
    st_save({"w": torch.randn(100)}, data / "good.safetensors")
    raw = (data / "good.safetensors").read_bytes()
    (data / "cut.safetensors").write_bytes(raw[: len(raw) // 2])
    (data / "junk.safetensors").write_bytes(b"\x10\0\0\0\0\0\0\0{not json at all")
    count = rgpu.session_info()["tensors"]
    _refused(
        lambda: rf.load_file("cut.safetensors"), "cut.safetensors is not a valid safetensors file"
    )
    _refused(
        lambda: rf.load_file("junk.safetensors"), "junk.safetensors is not a valid safetensors file"
    )
    (data / "bad.pt").write_bytes(b"not a zip or pickle")
    _refused(lambda: rf.load("bad.pt"), "bad.pt is not a torch.save file")
    assert rgpu.session_info()["tensors"] == count  # no tensor was left behind


def test_torch_load_rules_refuse_arbitrary_objects(files):
    data, _, _ = files
    torch.save({"model": torch.nn.Linear(2, 2)}, data / "whole.pt")  # a pickled module
    _refused(
        lambda: rf.load("whole.pt"),
        r"weights_only=True\) rules: it holds a torch.nn.modules.linear.Linear",
    )
    with pytest.raises(TypeError, match="Linear is none of them"):
        rf.save({"m": torch.nn.Linear(2, 2)}, "x.pt")


def test_files_over_the_quota_or_the_disk_limit_are_refused(tmp_path, start_server):
    srv = start_server(
        "--data-dir", str(tmp_path), "--session-quota-mb", "32", "--max-disk-mb", "48"
    )
    rgpu.connect(srv.url)
    _over_the_limits(tmp_path)


def _over_the_limits(data):
    def twenty_mib() -> dict:
        return {"a": torch.zeros(20 << 20, dtype=torch.uint8, device="rgpu")}

    rf.save_file(twenty_mib(), "q1.safetensors")
    # what one session writes counts against its quota (32 MiB)
    _refused(
        lambda: rf.save_file(twenty_mib(), "q2.safetensors"), "past its quota of 33554432 bytes"
    )
    assert not (data / "q2.safetensors").exists()
    rgpu.connect(rgpu.current_session().url)  # a new session, but the same server's disk limit
    rf.save_file(twenty_mib(), "q2.safetensors")
    rgpu.connect(rgpu.current_session().url)
    _refused(lambda: rf.save_file(twenty_mib(), "q3.safetensors"), "disk limit of 50331648 bytes")
    rf.remove("q1.safetensors")  # frees its bytes for everyone
    rf.save_file(twenty_mib(), "q3.safetensors")
    rf.remove("q2.safetensors")
    rf.remove("q3.safetensors")
    local = data.parent / "local.bin"
    local.write_bytes(bytes(40 << 20))
    rgpu.connect(rgpu.current_session().url)
    _refused(
        lambda: rf.upload(local, "big.bin"), "uploading 'big.bin' would pass this session's quota"
    )
    assert not list(data.iterdir())  # no file, and no partial left behind


def test_a_server_without_data_dirs_names_the_flag(server, tmp_path):
    rgpu.connect(server.url)
    _refused(lambda: rf.load_file("x.safetensors"), "no data directory.*--data-dir DIR")
    _refused(lambda: rf.listdir(""), "--data-dir")


def test_loads_land_on_the_named_or_the_current_device(tmp_path, start_server):
    srv = start_server("--virtual-devices", "2", "--data-dir", str(tmp_path))
    rgpu.connect(srv.url)
    x = torch.arange(6.0).reshape(2, 3)
    st_save({"x": x}, tmp_path / "x.safetensors")
    torch.save({"x": x, "n": 3}, tmp_path / "x.pt")
    x.numpy().tofile(tmp_path / "x.bin")
    one = torch.device("rgpu", 1)
    named = [
        rf.load_file("x.safetensors", device="rgpu:1")["x"],
        rf.load_file("x.safetensors", device=one)["x"],
        rf.load("x.pt", map_location="rgpu:1")["x"],
        rf.load("x.pt", map_location=1)["x"],
    ]
    torch.rgpu.set_device(1)
    try:
        current = [
            rf.load_file("x.safetensors")["x"],
            rf.load("x.pt")["x"],
            rf.load("x.pt", map_location="rgpu")["x"],
            rf.from_file("x.bin", torch.float32, shape=(2, 3)),
        ]
    finally:
        torch.rgpu.set_device(0)
    for t in named + current:
        assert t.device == one
        assert torch.equal((t + torch.ones(3, device="rgpu:1")).cpu(), x + 1)
    torch.rgpu.synchronize()
    assert torch.rgpu.memory_allocated(0) == 0  # counted on the device they are on
    assert torch.rgpu.memory_allocated(1) > 0
    rf.save({"y": named[0] * 2}, "y.pt")
    assert torch.equal(torch.load(tmp_path / "y.pt")["y"], x * 2)
    with pytest.raises(ValueError, match="onto rgpu devices"):
        rf.load("x.pt", map_location="cpu")
    with pytest.raises(rgpu.NoSuchDevice, match="rgpu:5 does not exist"):
        rf.load_file("x.safetensors", device="rgpu:5")
    assert rf.load_file("x.safetensors")["x"].device == torch.device("rgpu", 0)
