"""The per-cell advisor and the words the widget and `%rgpu status` use for times and devices."""

from __future__ import annotations

import linecache

import pytest

from rgpu_jupyter.accounting import CellCost, only_rgpu_magics
from rgpu_jupyter.advice import advise, fix_for
from rgpu_jupyter.render import memory_text, time_split, utilization_text
from rgpu_jupyter.report import format_seconds

CELL = "/tmp/ipykernel_1/cell7.py"


def cost(**kw) -> CellCost:
    return CellCost(key="k", label="", number=7, **kw)


@pytest.fixture
def cell_source():
    linecache.cache[CELL] = (
        0,
        None,
        ["x = 1\n", "for s in range(62):\n", "    loss.item()\n"],
        CELL,
    )
    yield
    linecache.cache.pop(CELL, None)


def test_no_advice_when_waiting_was_not_most_of_the_cell():
    assert advise(cost(waits=62, wait_seconds=0.15, wall_seconds=0.2)) is None  # < 0.2 s
    assert advise(cost(waits=62, wait_seconds=0.9, wall_seconds=2.0)) is None  # < half
    assert advise(cost()) is None


def test_many_waits_from_one_line_name_the_line_and_the_fix(cell_source):
    c = cost(waits=62, wait_seconds=1.5, wall_seconds=2.0, busiest=(CELL, 3), busiest_waits=62)
    assert advise(c, rtt=0.02) == (
        "62 waits from `loss.item()` at cell7.py, line 3 (a round trip of 20.0 ms each): "
        'read it with .to("cpu", non_blocking=True) (not a wait), or every N steps'
    )


def test_re_uploads_of_the_same_data_say_keep_it_on_rgpu():
    c = cost(waits=3, wait_seconds=3.0, wall_seconds=4.0, dedup_hits=3,
             dedup_bytes_saved=3 * (400 << 20))  # fmt: skip
    assert advise(c) == (
        "re-uploaded the same 400.0 MiB 3 times (the server had it): keep it on rgpu, move it "
        "once before the loop"
    )


def test_big_transfers_blame_the_bandwidth():
    c = cost(waits=1, wait_seconds=3.0, wall_seconds=3.1, bytes_in=381 << 20, bytes_out=1024)
    assert advise(c).startswith("moved 1.0 KiB out and 381.0 MiB in: the link's bandwidth")


def test_a_few_long_waits_are_the_device_computing_and_get_no_advice():
    assert advise(cost(waits=1, wait_seconds=2.5, wall_seconds=2.6)) is None
    assert advise(cost(waits=9, wait_seconds=2.5, wall_seconds=2.6)) is None


@pytest.mark.parametrize(
    "code, fix",
    [
        ("total += loss.item()", "non_blocking=True"),
        ("acc = float(correct.sum())", "non_blocking=True"),
        ("preds.append(p.cpu())", "torch.stack"),
        ("print(loss)", "print every N steps"),
        ("if (x > 0).any():", "torch.where"),
        ("y = f(x)", "read them once"),
    ],
)
def test_the_fix_fits_the_line(code, fix):
    assert fix in fix_for(code)


def test_times_never_read_zero_microseconds():
    assert [format_seconds(s) for s in (0, None, 1e-7, 2.4e-6, 0.0125, 3.214)] == [
        "—",
        "—",
        "<1 µs",
        "2 µs",
        "12.5 ms",
        "3.21 s",
    ]


def test_time_split_says_how_much_was_waiting():
    assert (
        time_split(cost(wall_seconds=3.21, wait_seconds=2.5))
        == "3.21 s, 2.50 s of it waiting (78%)"
    )
    assert time_split(cost(wall_seconds=0.5)) == "500.0 ms"


def test_device_facts_in_words():
    cpu = {"memory_used": 3 << 30, "memory_total": 24 << 30, "memory_process": 200 << 20,
           "bytes": 4096, "utilization": None, "utilization_note": "n/a on a CPU server",
           "load_average": 1.5, "cpus": 2}  # fmt: skip
    assert memory_text(cpu) == (
        "3.0 GiB / 24.0 GiB host RAM, this session 4.0 KiB (server process 200.0 MiB)"
    )
    assert utilization_text(cpu) == "n/a on a CPU server (load 1.50 on 2 cores)"
    gpu = {"memory_used": 50 << 30, "memory_total": 80 << 30, "utilization": 87,
           "utilization_note": "NVML"}  # fmt: skip
    assert memory_text(gpu) == "50.0 GiB / 80.0 GiB device memory"
    assert utilization_text(gpu) == "87% (NVML)"
    assert memory_text({"memory_used": None, "memory_total": None}) is None


@pytest.mark.parametrize(
    "source, only",
    [
        ("%rgpu status", True),
        ("%load_ext rgpu_jupyter\n%rgpu connect local\n", True),
        ("# check\n%rgpu stats -o", True),
        ("%rgpu status\nx = 1", False),
        ("%%rgpu\nx.sum().item()", False),
        ("%rgpux", False),
        ("", False),
    ],
)
def test_cells_of_rgpu_magics_only_are_recognised(source, only):
    assert only_rgpu_magics(source) is only
