"""`%rgpu` / `%%rgpu` in a real IPython shell against a real rgpu-server subprocess.

One global test shell for the module (IPython's `start_ipython()` returns it only on its first
call). Cells run through `ip.run_cell`, so IPython's own pre/post_run_cell events drive the
accounting exactly as in a notebook.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output
from ipywidgets.widgets.widget import _instances

import rgpu
import rgpu_jupyter
from rgpu_jupyter.accounting import CellAccounting
from rgpu_jupyter.report import CellStats

LINE = re.compile(
    r"^rgpu: (\d+) messages?, (\d+) waits?, \d+(\.\d)? (B|KiB|MiB|GiB) out, \d+(\.\d)? (B|KiB|MiB|GiB) in$"
)


@pytest.fixture(scope="module")
def ip():
    import IPython
    from IPython.testing.globalipapp import start_ipython

    shell = start_ipython() or IPython.get_ipython()
    shell.run_line_magic("load_ext", "rgpu_jupyter")
    shell.run_cell("import torch, rgpu")
    yield shell
    shell.run_line_magic("unload_ext", "rgpu_jupyter")


@pytest.fixture
def connected(ip, server, capsys):
    """The shell, connected to the test server through %rgpu connect, with an empty free list."""
    if rgpu.current_session() is None or rgpu.current_session().url != server.url:
        ip.run_line_magic("rgpu", f"connect {server.url}")
    torch.rgpu.synchronize()  # drains frees left by earlier tests, so counts start clean
    capsys.readouterr()
    return ip


def magics(ip) -> rgpu_jupyter.RgpuMagics:
    return ip._rgpu_jupyter_magics


def accounting_hooks(ip) -> list:
    return [
        cb
        for event in ("pre_run_cell", "post_run_cell")
        for cb in ip.events.callbacks[event]
        if isinstance(getattr(cb, "__self__", None), CellAccounting)
    ]


# -- connect, status, disconnect ------------------------------------------------------------


def test_connect_prints_one_line_with_server_device_and_rtt(ip, server, capsys):
    ip.run_line_magic("rgpu", f"connect {server.url}")
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1
    assert re.fullmatch(
        rf"rgpu: connected to {re.escape(server.url)}, cpu \(CPU.*\), RTT \d+(\.\d+)? (µs|ms|s)",
        out[0],
    ), out
    assert rgpu.current_session().url == server.url


def test_connect_shows_the_widget_in_a_kernel_unless_turned_off(ip, server, monkeypatch):
    m = magics(ip)
    monkeypatch.setattr(m, "_frontend_shows_widgets", lambda: True)
    with capture_output() as shown:
        ip.run_line_magic("rgpu", f"connect {server.url}")
    assert len(shown.outputs) == 1
    assert shown.outputs[0].data["text/plain"] == f"RgpuWidget(server={server.url})"
    core, (first,) = m._widget, m._placement.frames
    with capture_output() as again:
        ip.run_line_magic("rgpu", "widget")  # the same widget, shown once more: it moves
    assert len(again.outputs) == 1 and m._widget is core
    assert again.outputs[0].data["text/plain"] == f"RgpuWidget(server={server.url})"
    (second,) = m._placement.frames
    assert second is not first and second.children == (core,)
    assert first.children != (core,) and "moved to a later cell" in first.children[0].value
    assert [f for f in _instances.values() if core in getattr(f, "children", ())] == [second]
    ip.run_line_magic("config", "RgpuMagics.stats_interval = 0.5")
    assert m._widget.interval == 0.5 and m._widget.running
    ip.run_line_magic("config", "RgpuMagics.stats_interval = 0.2")
    ip.run_line_magic("config", "RgpuMagics.widget = False")
    try:
        with capture_output() as shown:
            ip.run_line_magic("rgpu", f"connect {server.url}")
        assert shown.outputs == []
    finally:
        ip.run_line_magic("config", "RgpuMagics.widget = True")
        m.close()


def test_connect_in_a_terminal_shows_no_widget(ip, server):
    with capture_output() as shown:
        ip.run_line_magic("rgpu", f"connect {server.url}")
    assert shown.outputs == []
    assert shown.stdout.startswith("rgpu: connected to ")


def test_status_names_server_versions_session_holdings_and_rtt(connected, capsys):
    keep = [torch.ones(4, device="rgpu"), torch.ones(8, device="rgpu")]
    connected.run_line_magic("rgpu", "status")
    out = capsys.readouterr().out
    s = rgpu.current_session()
    assert re.search(
        rf"^server +{re.escape(s.url)} \(rgpu-server .+, torch {re.escape(s.server_torch)}\)$",
        out,
        re.M,
    )
    assert re.search(r"^device +cpu \(CPU.*\)$", out, re.M)
    assert re.search(
        rf"^client +rgpu {re.escape(rgpu.__version__)}, torch {re.escape(torch.__version__)}$",
        out,
        re.M,
    )
    assert re.search(rf"^session +{s.session_id}$", out, re.M)
    assert re.search(r"^state +connected$", out, re.M)
    held = re.search(r"^held +(\d+) tensors?, (\d+) B on the server$", out, re.M)
    assert held and int(held.group(1)) >= 2 and int(held.group(2)) >= 48
    assert re.search(r"^RTT +\d+(\.\d+)? (µs|ms|s)$", out, re.M)
    del keep


def test_disconnect_ends_the_session(connected, server, capsys):
    connected.run_line_magic("rgpu", "disconnect")
    assert capsys.readouterr().out.strip() == f"rgpu: disconnected from {server.url}"
    assert rgpu.current_session() is None
    with pytest.raises(UsageError, match="not connected"):
        connected.run_line_magic("rgpu", "status")


# -- %%rgpu ---------------------------------------------------------------------------------


def test_cell_magic_counts_a_loop_and_one_item_as_one_wait(connected, capsys):
    cell = "x = torch.zeros(16, device='rgpu')\nfor _ in range(100):\n    x = x + 1\nx.sum().item()"
    result = connected.run_cell("%%rgpu\n" + cell)
    assert result.success and result.result == 1600.0
    line = capsys.readouterr().out.splitlines()[0]
    m = LINE.match(line)
    assert m, line
    assert int(m.group(2)) == 1  # exactly one wait
    # zeros + 100 adds + sum + download = 103, and one FREE for the 100 dropped temporaries:
    # frees go out at op boundaries (here, before the download), never with a timed flush
    assert int(m.group(1)) == 104


def test_cell_magic_exact_line_when_nothing_is_freed(connected, capsys):
    connected.run_cell("x = torch.zeros(16, device='rgpu'); torch.rgpu.synchronize()")
    capsys.readouterr()
    result = connected.run_cell("%%rgpu\nfor _ in range(100):\n    x.add_(1)\nx.sum().item()")
    assert result.result == 1600.0
    line = capsys.readouterr().out.splitlines()[0]
    assert line.startswith("rgpu: 102 messages, 1 wait, ")  # 100 add_, sum, download
    assert LINE.match(line)


def test_cell_magic_singular_and_zero(connected, capsys):
    connected.run_cell("%%rgpu\ny = 1 + 1")
    assert capsys.readouterr().out.strip() == "rgpu: 0 messages, 0 waits, 0 B out, 0 B in"


def test_cell_magic_returns_the_last_expression_and_keeps_names(connected, capsys):
    result = connected.run_cell("%%rgpu\nz = torch.arange(4.0, device='rgpu')\nz.sum().item() * 2")
    assert result.result == 12.0
    assert connected.user_ns["z"].device.type == "rgpu"
    assert LINE.match(capsys.readouterr().out.splitlines()[0])


def test_cell_magic_reports_a_shape_error_raised_before_anything_is_sent(connected, capsys):
    result = connected.run_cell(
        "%%rgpu\na = torch.ones(3, device='rgpu')\nb = torch.ones(4, device='rgpu')\na + b"
    )
    assert isinstance(result.error_in_exec, RuntimeError)
    assert "broadcast" in str(result.error_in_exec)
    out = capsys.readouterr().out
    assert "rgpu: 2 messages, 0 waits, " in out  # the two factories; the bad add never left


def test_cell_magic_takes_no_arguments(connected):
    with pytest.raises(UsageError, match="takes no arguments"):
        connected.run_cell_magic("rgpu", "status", "1 + 1")


# -- user mistakes --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("", "needs an action"),
        ("frobnicate", "invalid choice"),
        ("status ws://x:1", "takes no URL or token"),
        ("disconnect --token t", "takes no URL or token"),
        ("status -o", "belong to %rgpu stats"),
        ("connect ws://127.0.0.1:9 extra", "unrecognized arguments"),
        ("connect ftp://127.0.0.1:9", "ws:// or wss://"),
        ("connect 127.0.0.1:1", "cannot reach an rgpu server"),
        ("widget", "needs a Jupyter frontend"),
        ("status --side", "belong to %rgpu widget"),
        ("widget --side --inline", "choose one of --side / --inline"),
        ("widget --compact --full", "choose one of"),
    ],
)
def test_each_user_mistake_is_a_one_line_usage_error(ip, line, message):
    with pytest.raises(UsageError, match=re.escape(message)) as e:
        ip.run_line_magic("rgpu", line)
    assert "Traceback" not in str(e.value)


def test_a_usage_error_shows_as_one_line_in_a_cell(ip, capsys):
    result = ip.run_cell("%rgpu frobnicate")
    assert isinstance(result.error_in_exec, UsageError)
    err = capsys.readouterr()
    shown = (err.out + err.err).strip().splitlines()
    assert len(shown) == 1 and shown[0].startswith("UsageError: argument action: invalid choice"), (
        shown
    )


def test_help_comes_from_the_docstring(ip):
    doc = ip.find_line_magic("rgpu").__doc__
    assert "%rgpu connect [URL | local]" in doc and "%%rgpu" in doc and "--token" in doc
    assert ip.find_cell_magic("rgpu") is not None


# -- %rgpu stats ----------------------------------------------------------------------------


def test_stats_table_lists_recent_cells_and_marks_failures(connected, capsys):
    connected.run_line_magic("rgpu", "stats --clear")
    connected.run_cell("w = torch.ones(5, device='rgpu')\nw.sum().item()", cell_id="cell-a")
    connected.run_cell("w.tolist(); w.cpu(); torch.rgpu.synchronize()", cell_id="cell-b")
    connected.run_cell("w.tolist(); 1/0", cell_id="cell-c")
    connected.run_cell("pass", cell_id="no-rgpu")  # touches nothing: not recorded
    capsys.readouterr()
    table = connected.run_line_magic("rgpu", "stats -o")
    assert isinstance(table, CellStats)
    assert [r.waits for r in table.rows] == [1, 3, 1]
    assert [r.success for r in table.rows] == [True, True, False]
    text = repr(table)
    assert text.splitlines()[0].split() == [
        "cell",
        "messages",
        "waits",
        "out",
        "in",
        "wait",
        "wall",
        "code",
    ]
    assert re.search(r"^\[\d+\]! +\d+ +1 +.* w\.tolist\(\); 1/0$", text, re.M)
    assert (
        "<table" in table._repr_html_()
        and "w = torch.ones(5, device=&#x27;rgpu&#x27;)" in table._repr_html_()
    )
    connected.run_line_magic("rgpu", "stats")
    assert capsys.readouterr().out.strip() == text
    connected.run_line_magic("rgpu", "stats --clear")
    assert len(connected.run_line_magic("rgpu", "stats -o")) == 0


# -- the accounting hooks -------------------------------------------------------------------


def test_cells_are_keyed_by_cell_id_and_a_rerun_replaces_its_row(connected):
    acc = magics(connected).accounting
    acc.clear()
    connected.run_cell("v = torch.ones(2, device='rgpu').sum().item()", cell_id="same")
    connected.run_cell("v = torch.ones(2, device='rgpu').sum().item()", cell_id="same")
    connected.run_cell("v = torch.ones(2, device='rgpu').sum().item()", cell_id="other")
    assert list(acc.history) == ["same", "other"]
    assert acc.history["same"].waits == 1


def test_without_cell_ids_a_counter_keys_cells_not_execution_count(connected):
    acc = magics(connected).accounting
    acc.clear()
    count = connected.execution_count
    for _ in range(3):  # nbval's way: store_history=False leaves execution_count unchanged
        connected.run_cell("torch.ones(2, device='rgpu').sum().item()", store_history=False)
    assert connected.execution_count == count
    assert len(acc.history) == 3 and all(k.startswith("#") for k in acc.history)
    assert [r.waits for r in acc.recent()] == [1, 1, 1]


def test_a_nested_run_cell_belongs_to_the_outer_cell(connected):
    acc = magics(connected).accounting
    acc.clear()
    connected.run_cell(
        "%%capture\nget_ipython().run_cell('torch.ones(2, device=\"rgpu\").sum().item()')\n"
        "torch.ones(2, device='rgpu').sum().item()"
    )
    assert [r.waits for r in acc.recent()] == [2]


def test_hooks_never_print_or_raise(connected, capsys):
    acc = magics(connected).accounting
    broken = acc.snapshot
    errors = acc.errors

    def fail():
        raise RuntimeError("stats exploded")

    acc.snapshot = fail
    try:
        result = connected.run_cell("print('only this')")
        assert result.success
        captured = capsys.readouterr()
        assert captured.out == "only this\n" and captured.err == ""
        assert acc.errors == errors + 1
    finally:
        acc.snapshot = broken
    acc.post_run_cell(SimpleNamespace())  # nonsense arguments are swallowed too
    acc.pre_run_cell(object())
    acc.post_run_cell(None)
    assert capsys.readouterr() == ("", "")


def test_reconnecting_inside_a_cell_counts_from_the_new_session(connected, server):
    acc = magics(connected).accounting
    acc.clear()
    connected.run_cell(
        "torch.manual_seed(0)\n"
        f"rgpu.connect({server.url!r})\n"
        "torch.ones(2, device='rgpu').sum().item()"
    )
    (row,) = acc.recent()
    before = rgpu.stats()["messages"]
    torch.ones(2, device="rgpu").sum().item()
    same_work = rgpu.stats()["messages"] - before
    # the new session's own messages only (nothing of the old one is subtracted): the seed it
    # is given at connect, torch's numeric settings if an earlier test left any changed, then
    # the work
    settings = 1 if rgpu.numerics.CHANGES else 0
    assert (row.waits, row.messages) == (1, 1 + settings + same_work)


# -- load / unload / reload -----------------------------------------------------------------


def test_reload_and_unload_never_double_register_hooks(ip):
    assert len(accounting_hooks(ip)) == 2
    ip.run_line_magic("reload_ext", "rgpu_jupyter")
    assert len(accounting_hooks(ip)) == 2
    rgpu_jupyter.load_ipython_extension(ip)  # a second direct load replaces the first
    assert len(accounting_hooks(ip)) == 2
    ip.run_line_magic("unload_ext", "rgpu_jupyter")
    assert accounting_hooks(ip) == []
    assert ip.find_line_magic("rgpu") is None
    assert not any(isinstance(c, rgpu_jupyter.RgpuMagics) for c in ip.configurables)
    ip.run_line_magic("load_ext", "rgpu_jupyter")
    assert len(accounting_hooks(ip)) == 2 and ip.find_line_magic("rgpu") is not None


def test_settings_are_traitlets_set_with_config(ip):
    before = rgpu.settings.progress_bytes
    try:
        ip.run_line_magic("config", "RgpuMagics.progress_mb = 2")
        assert rgpu.settings.progress_bytes == 2 << 20
        ip.run_line_magic("config", "RgpuMagics.stats_interval = 0.01")
        assert magics(ip).stats_interval == 0.1  # at most 10 refreshes a second
        ip.run_line_magic("config", "RgpuMagics.history = 3")
        assert magics(ip).accounting.keep == 3
    finally:
        ip.run_line_magic("config", f"RgpuMagics.progress_mb = {before / (1 << 20)}")
        ip.run_line_magic("config", "RgpuMagics.stats_interval = 0.2")
        ip.run_line_magic("config", "RgpuMagics.history = 20")
    assert rgpu.settings.progress_bytes == before


def test_the_cell_that_loads_the_extension_is_counted_from_the_load(ip, server):
    ip.run_line_magic("unload_ext", "rgpu_jupyter")
    cell = f"%load_ext rgpu_jupyter\n%rgpu connect {server.url}\ntorch.ones(2, device='rgpu').sum().item()"
    assert ip.run_cell(cell, cell_id="loader").success
    row = magics(ip).accounting.history["loader"]
    assert row.waits == 1 and row.label == "%load_ext rgpu_jupyter"
    assert magics(ip).accounting._running is None


def test_what_earlier_cells_left_queued_is_not_the_next_cells_cost(connected):
    acc = magics(connected).accounting
    acc.clear()
    connected.run_cell(
        "t = torch.ones(3, device='rgpu') * 2", cell_id="makes-garbage"
    )  # ones is freed
    connected.run_cell("t.sum().item()", cell_id="reads")
    assert acc.history["makes-garbage"].messages == 2  # ones, mul
    assert (
        acc.history["reads"].messages == 2
    )  # sum, download; not the FREE of the first cell's ones
    assert acc.history["reads"].waits == 1


def test_a_bad_url_scheme_is_refused_without_ending_the_session(connected, server):
    before = rgpu.current_session()
    with pytest.raises(UsageError, match="ws:// or wss://"):
        connected.run_line_magic("rgpu", "connect http://127.0.0.1:1")
    assert rgpu.current_session() is before and before.state == "connected"


def test_status_shows_a_pending_server_error_instead_of_raising_it(connected, capsys):
    src = torch.arange(5.0, device="rgpu")
    torch.gather(src, 0, torch.tensor([0, 7], device="rgpu"))
    connected.run_line_magic("rgpu", "status")
    out = capsys.readouterr().out
    assert re.search(r"^state +connected$", out, re.M)
    assert re.search(
        r"^error +aten::gather\.default failed on the rgpu server( \(queued at [^)]*\))?: .*index 7",
        out,
        re.M,
    ), out
    torch.rgpu.synchronize()  # reported once


def test_ls_lists_a_folder_on_the_server_with_sizes(ip, tmp_path, capsys, start_server):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "data.bin").write_bytes(bytes(3000))
    srv = start_server("--data-dir", str(tmp_path))
    ip.run_line_magic("rgpu", f"connect {srv.url}")
    capsys.readouterr()
    ip.run_line_magic("rgpu", "ls")
    assert capsys.readouterr().out.splitlines() == ["2.9 KiB  data.bin", "      -  model/"]
    ip.run_line_magic("rgpu", "ls model")
    assert capsys.readouterr().out.splitlines() == ["2 B  config.json"]
    with pytest.raises(UsageError, match="rgpu: .*climbs out with '..'"):
        ip.run_line_magic("rgpu", "ls ../")


def test_named_sessions_from_the_notebook(ip, capsys, start_server):
    srv = start_server()
    try:
        ip.run_line_magic("rgpu", f"connect {srv.url} --session nb1")
        out = capsys.readouterr().out.splitlines()
        assert out[1] == "rgpu: session 'nb1' (named: it outlives this kernel)"
        ip.run_cell("_ = rgpu.keep('w', torch.arange(3.0, device='rgpu'))")
        capsys.readouterr()
        ip.run_line_magic("rgpu", f"connect {srv.url} --session nb1")  # as after a restart
        assert (
            capsys.readouterr().out.splitlines()[1] == "rgpu: session 'nb1' re-opened; it keeps: w"
        )
        ip.run_line_magic("rgpu", f"connect {srv.url} --session nb2")
        capsys.readouterr()
        ip.run_line_magic("rgpu", "sessions")
        listing = capsys.readouterr().out.splitlines()
        assert [line.split(":")[0] for line in listing] == ["  nb1", "* nb2"]
        assert "detached since" in listing[0] and "kept: w" in listing[0]
        ip.run_line_magic("rgpu", "drop nb1")
        assert capsys.readouterr().out.strip() == "rgpu: dropped the session 'nb1'"
        ip.run_line_magic("rgpu", "sessions")
        assert [line.split(":")[0] for line in capsys.readouterr().out.splitlines()] == ["* nb2"]
        with pytest.raises(UsageError, match="belong to %rgpu connect"):
            ip.run_line_magic("rgpu", "status --session x")
    finally:
        rgpu.disconnect(drop=True)


def test_a_server_failure_names_the_cell_and_line_that_queued_it(connected, capsys):
    ip = connected
    ip.run_cell(
        "x = torch.ones(2, 2, device='rgpu')\nbad = x.index_select(0, torch.tensor([5]).to('rgpu'))\ny = bad + 1",
        store_history=True,
    )
    queued_in = ip.execution_count - 1
    capsys.readouterr()
    result = ip.run_cell("print('later')\ny.sum().item()", store_history=True)
    assert isinstance(result.error_in_exec, rgpu.RemoteError)
    assert result.error_in_exec.site == f"cell [{queued_in}], line 2"
    shown = capsys.readouterr().out.splitlines()
    assert shown[0] == "later"
    assert shown[1:4] == ["Traceback (most recent call last):", f"  cell [{queued_in + 1}], line 2",
                          "    y.sum().item()"]  # fmt: skip
    assert re.fullmatch(r"  \[\d+ frame\(s\) inside rgpu, torch and Python hidden\]", shown[4])
    assert shown[5].startswith(
        f"rgpu.errors.RemoteError: aten::index_select.default failed on the rgpu server (queued at cell [{queued_in}], line 2)"
    )
    assert len(shown) == 6  # no rgpu frame shown


# -- the second round (issue 16) --------------------------------------------------------------


def test_cells_are_numbered_by_their_execution_count_after_a_reload(connected):
    connected.run_line_magic("reload_ext", "rgpu_jupyter")
    acc = magics(connected).accounting
    for _ in range(2):
        connected.run_cell("torch.ones(2, device='rgpu').sum().item()", store_history=True)
    counts = [connected.execution_count - 2, connected.execution_count - 1]
    assert [r.number for r in acc.recent()] == counts


def test_cells_of_rgpu_magics_only_are_not_counted(connected):
    acc = magics(connected).accounting
    acc.clear()
    with capture_output():
        connected.run_cell("%rgpu status", cell_id="status")
        connected.run_cell("# just looking\n%rgpu status", cell_id="status2")
        connected.run_cell("%rgpu status\nv = torch.ones(2, device='rgpu').sum().item()",
                           cell_id="work")  # fmt: skip
    assert list(acc.history) == ["work"]


def test_status_shows_device_memory_use_and_the_last_cell(connected, capsys):
    connected.run_cell("v = torch.ones(2, device='rgpu').sum().item()", cell_id="one")
    capsys.readouterr()
    connected.run_line_magic("rgpu", "status")
    out = capsys.readouterr().out
    assert re.search(
        r"^memory +\d+\.\d [KMGT]iB / \d+\.\d [KMGT]iB host RAM, this session \d+(\.\d)? (B|KiB|MiB)"
        r" \(server process \d+\.\d [KMG]iB\)$",
        out,
        re.M,
    ), out
    assert re.search(r"^use +n/a on a CPU server \(load \d+\.\d\d on \d+ cores?\)$", out, re.M)
    number = magics(connected).accounting.recent(1)[0].number
    assert re.search(rf"^cell \[{number}\] +\d", out, re.M), out


def test_cell_magic_prints_advice_when_the_cell_mostly_waited(connected, capsys, monkeypatch):
    import rgpu_jupyter.advice as advice

    monkeypatch.setattr(advice, "MIN_WAIT_S", 0.0)
    monkeypatch.setattr(advice, "WAIT_SHARE", 0.0)
    connected.run_cell(
        "%%rgpu\nx = torch.ones(2, device='rgpu')\nfor _ in range(12):\n    x.sum().item()"
    )
    out = capsys.readouterr().out.splitlines()
    assert LINE.match(out[0]) and out[0].split(", ")[1] == "12 waits"
    assert re.match(
        r"^rgpu: advice: 12 waits from `x.sum\(\).item\(\)` at cell \[\d+\], line 4 ?"
        r"(\(a round trip of .+ each\))?: read it with \.to\(\"cpu\", non_blocking=True\)",
        out[1],
    ), out


def test_cell_magic_prints_no_advice_for_a_cell_that_did_not_wait_long(connected, capsys):
    connected.run_cell("%%rgpu\nv = torch.ones(2, device='rgpu').sum().item()")
    assert len(capsys.readouterr().out.splitlines()) == 1


def test_hints_use_the_magic_form_in_ipython(ip, server):
    from rgpu.errors import hint

    with pytest.raises(UsageError) as e:
        ip.run_line_magic("rgpu", f"connect {server.url} --token wrong")
    assert "pass it with %rgpu connect URL --token TOKEN, the RGPU_TOKEN" in str(e.value)
    assert (
        hint("call rgpu.connect(url) to use a remote GPU")
        == "run %rgpu connect URL to use a remote GPU"
    )


def test_hints_stay_python_without_the_magic(ip):
    from rgpu.errors import hint

    ip.run_line_magic("unload_ext", "rgpu_jupyter")
    try:
        assert hint("Call rgpu.connect() to start") == "Call rgpu.connect() to start"
    finally:
        ip.run_line_magic("load_ext", "rgpu_jupyter")


def test_side_panel_without_sidecar_says_so_and_shows_the_widget_here(ip, server, monkeypatch):
    import sys

    m = magics(ip)
    monkeypatch.setattr(m, "_frontend_shows_widgets", lambda: True)
    monkeypatch.setitem(sys.modules, "sidecar", None)
    try:
        with capture_output() as shown:
            ip.run_line_magic("rgpu", f"connect {server.url}")
            ip.run_line_magic("rgpu", "widget --side")
        assert "the side panel needs the sidecar package (pip install sidecar" in shown.stdout
        assert len(shown.outputs) == 2 and m._placement.sidecar is None
    finally:
        m.close()


def test_side_panel_holds_the_one_widget_and_connect_leaves_it_there(ip, server, monkeypatch):
    pytest.importorskip("sidecar")
    m = magics(ip)
    monkeypatch.setattr(m, "_frontend_shows_widgets", lambda: True)
    try:
        with capture_output() as shown:
            ip.run_line_magic("rgpu", f"connect {server.url}")
            ip.run_line_magic("rgpu", "widget --side --compact")
            ip.run_line_magic("rgpu", f"connect {server.url}")  # no copy in this cell
        assert "in JupyterLab's side panel" in shown.stdout
        assert m._placement.in_side_panel and m._widget.compact
        (frame,) = m._placement.frames
        assert frame.children == (m._widget,)
        assert len(shown.outputs) == 2  # the first connect's widget, and the frame in the panel
        with capture_output():
            ip.run_line_magic("rgpu", "widget --full")  # back into the cell
        assert not m._placement.in_side_panel and not m._widget.compact
    finally:
        m.close()


def test_an_interrupt_shows_rgpus_note_on_the_queued_work(ip, capsys):
    """IPython 8 leaves exception notes out of tracebacks; the extension prints rgpu's."""
    ip.run_cell(
        "e = KeyboardInterrupt()\n"
        "e.add_note('rgpu: the server skips the work of up to 3 queued message(s)')\n"
        "e.add_note('not ours')\n"
        "raise e"
    )
    out = capsys.readouterr().out
    assert "rgpu: the server skips the work of up to 3 queued message(s)\n" in out
    assert "not ours\n" not in out
