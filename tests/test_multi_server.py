"""Several rgpu servers as one device list: real server processes, a copy between them that
goes from server to server, and one of them killed while the other keeps working."""

from __future__ import annotations

import pytest
import torch
from rgpu_test_servers import ServerProcess
from safetensors.torch import load_file as st_load

import rgpu
import rgpu.files as rf


@pytest.fixture
def two(monkeypatch):
    monkeypatch.setenv("RGPU_RECONNECT_SECONDS", "1")  # a killed server is given up on soon
    a, b = ServerProcess("--virtual-devices", "2"), ServerProcess()
    yield a, b
    rgpu.disconnect()
    a.stop()
    b.stop()


def test_two_servers_number_their_devices_in_order(two):
    a, b = two
    rgpu.connect([a.url, b.url])
    assert torch.rgpu.device_count() == 3
    listed = rgpu.device_list()
    assert [d["server"] for d in listed] == [a.url, a.url, b.url]
    assert "virtual device 1 of 2" in listed[1]["name"]
    x = torch.arange(6.0, device="rgpu:1")
    y = torch.arange(6.0, device="rgpu:2") * 2
    assert x.device.index == 1 and y.device.index == 2
    assert (x + 1).sum().item() == 21.0
    assert (y + 1).sum().item() == 36.0
    assert rgpu.stats()["waits"] >= 2  # counters of both sessions together


def test_rgpu_server_with_commas_is_a_device_list(two, monkeypatch):
    a, b = two
    monkeypatch.setenv("RGPU_SERVER", f"{b.url}, {a.url}")
    rgpu.disconnect()
    rgpu.connect()
    assert [d["server"] for d in rgpu.device_list()] == [b.url, a.url, a.url]


def test_the_same_server_twice_is_refused(two):
    a, _ = two
    with pytest.raises(rgpu.ConnectError, match="same rgpu server"):
        rgpu.connect([a.url, a.url.replace("127.0.0.1", "localhost")])


def test_a_copy_between_servers_goes_server_to_server(two):
    a, b = two
    rgpu.connect([a.url, b.url])
    data = torch.randn(512, 512)  # 1 MiB
    x = data.to("rgpu:1")
    torch.rgpu.synchronize(1)
    before = rgpu.stats()
    y = x.to("rgpu:2")  # from server A to server B
    back = torch.empty(512, 512, device="rgpu:0")
    back.copy_(y.t())  # and from B to A, through a view
    torch.rgpu.synchronize(2)
    torch.rgpu.synchronize(0)
    moved = {k: rgpu.stats()[k] - before[k] for k in ("bytes_out", "bytes_in", "lane_transfers")}
    assert moved["bytes_out"] < 2048 and moved["bytes_in"] < 256 and moved["lane_transfers"] == 0
    assert y.device == torch.device("rgpu", 2)
    assert torch.equal(y.cpu(), data)
    assert torch.equal(back.cpu(), data.t())
    assert "imported 1048576 bytes" in b.wait_log("imported 1048576 bytes")


def test_losing_one_server_fails_only_its_devices(two):
    a, b = two
    rgpu.connect([a.url, b.url])
    on_a = torch.ones(4, device="rgpu:0")
    on_b = torch.ones(4, device="rgpu:2")
    assert on_b.sum().item() == 4.0
    b.proc.kill()
    b.proc.wait()
    with pytest.raises(rgpu.ConnectionLost):
        (on_b + 1).cpu()
    with pytest.raises(rgpu.ConnectionLost):
        torch.ones(2, device="rgpu:2")
    assert (on_a * 3).sum().item() == 12.0  # server A's devices carry on
    assert torch.ones(2, device="rgpu:1").sum().item() == 2.0
    assert [d["state"] for d in rgpu.device_list()] == ["connected", "connected", "lost"]


def test_percent_rgpu_connect_takes_several_urls_and_status_lists_devices(two, capsys):
    import IPython
    from IPython.testing.globalipapp import start_ipython

    ip = start_ipython() or IPython.get_ipython()
    ip.run_line_magic("load_ext", "rgpu_jupyter")
    try:
        a, b = two
        ip.run_line_magic("rgpu", f"connect {a.url} {b.url}")
        out = capsys.readouterr().out
        assert "2 servers (3 devices)" in out
        assert "rgpu:2  CPU" in out and b.url in out
        ip.run_line_magic("rgpu", "status")
        out = capsys.readouterr().out
        assert "rgpu:0" in out and "rgpu:1" in out and "rgpu:2" in out
        ip.run_line_magic("rgpu", "sessions")  # one line per server's session, naming it
        lines = capsys.readouterr().out.strip().splitlines()
        assert len(lines) == 2 and all(line.startswith("* ") for line in lines)
        assert f"on {a.url}:" in lines[0] and f"on {b.url}:" in lines[1]
        from rgpu_jupyter.widget import session_view

        view = session_view()
        assert view["device"] == "3 devices" and "rgpu:2" in view["devices"]
    finally:
        ip.run_line_magic("unload_ext", "rgpu_jupyter")


def test_the_peer_path_needs_a_capability_and_nothing_else_opens_without_the_token(two):
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    a, _ = two
    with pytest.raises(InvalidStatus) as refused:
        connect(a.url + "/peer", open_timeout=10)
    assert refused.value.response.status_code == 403
    with pytest.raises(InvalidStatus) as refused:
        connect(a.url + "/peer", additional_headers={"X-Rgpu-Capability": "zz"}, open_timeout=10)
    assert refused.value.response.status_code == 403
    with pytest.raises(InvalidStatus) as refused:
        connect(a.url, additional_headers={"X-Rgpu-Capability": "00" * 16}, open_timeout=10)
    assert refused.value.response.status_code == 401  # the capability opens /peer only


def test_generate_on_the_second_servers_device_equals_the_cpu(two):
    """transformers' stop check asks the server the tokens live on, not the first one."""
    transformers = pytest.importorskip("transformers")
    a, b = two
    rgpu.connect([a.url, b.url])
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100,
                                     n_positions=64, bos_token_id=0, eos_token_id=99,
                                     initializer_range=0.5)  # fmt: skip
    cpu = transformers.GPT2LMHeadModel(config).eval()
    prompt = torch.tensor([[5, 17, 3, 42]])
    kwargs = dict(max_new_tokens=10, do_sample=True, top_k=10, pad_token_id=0)
    torch.manual_seed(3)
    expected = cpu.generate(prompt, **kwargs)
    after = torch.randn(4)
    model = cpu.to("rgpu:2")
    torch.manual_seed(3)
    got = model.generate(prompt.to("rgpu:2"), **kwargs)
    assert torch.equal(got.cpu(), expected)
    assert torch.equal(torch.randn(4, device="rgpu:2").cpu(), after)


def test_keep_and_save_go_to_the_server_holding_the_tensors(tmp_path):
    data_a, data_b = tmp_path / "a", tmp_path / "b"
    data_a.mkdir()
    data_b.mkdir()
    a = ServerProcess("--virtual-devices", "2", "--data-dir", str(data_a))
    b = ServerProcess("--data-dir", str(data_b))
    try:
        rgpu.connect([a.url, b.url], session="both")
        x = torch.full((3,), 1.0, device="rgpu:1")
        y = torch.full((3,), 2.0, device="rgpu:2")  # on server B
        assert rgpu.keep("y", {"y": y, "step": torch.tensor(3)}) == 12
        rgpu.keep("x", x)
        rgpu.keep("moved", x)
        rgpu.keep("moved", y)  # the name now means y, on the other server
        assert rgpu.kept() == ["moved", "x", "y"]
        assert rf.save({"y": y, "cpu": torch.ones(2)}, "y.pt") > 0
        assert rf.save_file({"y": y, "cpu": torch.ones(2)}, "y.safetensors") > 0
        assert not list(data_a.iterdir())
        assert torch.equal(torch.load(data_b / "y.pt")["y"], torch.full((3,), 2.0))
        assert torch.equal(st_load(data_b / "y.safetensors")["cpu"], torch.ones(2))
        loaded = rf.load("y.pt", map_location="rgpu:2")["y"]  # read on server B
        assert loaded.device == torch.device("rgpu", 2)
        assert torch.equal((loaded + y).cpu(), torch.full((3,), 4.0))
        for call in (
            lambda: rgpu.keep("both", [x, y]),
            lambda: rf.save({"x": x, "y": y}, "xy.pt"),
            lambda: rf.save_file({"x": x, "y": y}, "xy.safetensors"),
        ):
            with pytest.raises(ValueError, match="tensors of two rgpu servers.*rgpu:1.*rgpu:2"):
                call()
        assert not list(data_a.iterdir()) and sorted(p.name for p in data_b.iterdir()) == [
            "y.pt",
            "y.safetensors",
        ]
        rgpu.disconnect()  # both named sessions stay for a later client
        rgpu.connect([a.url, b.url], session="both")
        kept_y, kept_x, moved = rgpu.kept("y"), rgpu.kept("x"), rgpu.kept("moved")
        assert kept_y["y"].device == torch.device("rgpu", 2) and kept_y["step"].item() == 3
        assert kept_x.device == torch.device("rgpu", 1)
        assert moved.device == torch.device("rgpu", 2)
        assert torch.equal((kept_y["y"] * moved).cpu(), torch.full((3,), 4.0))
        assert torch.equal(kept_x.cpu(), torch.ones(3))
        rgpu.forget("moved")
        assert rgpu.kept() == ["x", "y"]
        rgpu.disconnect(drop=True)
    finally:
        rgpu.disconnect()
        a.stop()
        b.stop()


def test_sessions_and_drop_session_reach_every_server(two):
    """With several servers, `rgpu.sessions()` listed only the first server's sessions and
    `drop_session` asked only it."""
    a, b = two
    rgpu.connect(b.url, session="held")
    rgpu.keep("t", torch.ones(3, device="rgpu"))
    rgpu.disconnect()  # detached on b, with what it keeps
    rgpu.connect([a.url, b.url])
    entries = rgpu.sessions()
    assert [(e.name, e.server, e.kept) for e in entries if not e.current] == [
        ("held", b.url, ("t",))
    ]
    assert sorted(e.server for e in entries if e.current) == sorted([a.url, b.url])
    rgpu.drop_session("held")
    assert [e.name for e in rgpu.sessions() if not e.current] == []
    with pytest.raises(rgpu.keeping.KeepError, match="no session named 'held'"):
        rgpu.drop_session("held")
