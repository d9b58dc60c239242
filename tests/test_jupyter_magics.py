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
    view = shown.outputs[0].data["application/vnd.jupyter.widget-view+json"]
    with capture_output() as again:
        ip.run_line_magic("rgpu", "widget")  # the same widget, shown once more
    assert again.outputs[0].data["application/vnd.jupyter.widget-view+json"] == view
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
    # is given at connect, then the work
    assert (row.waits, row.messages) == (1, 1 + same_work)


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
        r"^error +aten::gather\.default failed on the rgpu server: .*index 7", out, re.M
    ), out
    torch.rgpu.synchronize()  # reported once
