"""Run the benchmark suite and write BENCHMARKS.md plus its plots.

    python benchmarks/report.py                 # run everything (about 15 minutes here), then write
    python benchmarks/report.py --write-only    # rebuild BENCHMARKS.md from benchmarks/results/

Each benchmark writes its JSON document to benchmarks/results/<name>.json (every repeat, counters,
CPU times, load average); this script turns those into the tables of BENCHMARKS.md and draws
benchmarks/plots/*.png with matplotlib. The published rgpu 0.1.1 runs too when its virtualenv
exists (RGPU_PUBLISHED_PYTHON, default /tmp/anchor-venv/bin/python; see bench_published.py).
The prose that explains the numbers lives in benchmarks/NOTES.md and is appended as it is.
Plots need matplotlib (`pip install -e ".[bench]"`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

from report_more import section_ab, section_files, section_hf, section_replay

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
PLOTS = HERE / "plots"
PUBLISHED_PYTHON = os.environ.get("RGPU_PUBLISHED_PYTHON", "/tmp/anchor-venv/bin/python")

# name -> (interpreter, script and flags); "published" runs need rgpu 0.1.1's virtualenv
SUITE: dict[str, tuple[str, list[str]]] = {
    "core": ("ours", ["bench_core.py"]),
    "training": ("ours", ["bench_training.py"]),
    "compile": ("ours", ["bench_compile.py", "--repeats", "3"]),
    "latency": ("ours", ["bench_latency.py", "--compression"]),
    "files": ("ours", ["bench_files.py"]),
    "hf": ("ours", ["bench_hf.py"]),
    "ab": ("ours", ["ab_per_op.py", "965c006", "HEAD", "--rounds", "3"]),
    "devices": ("ours", ["bench_devices.py"]),
    "replay": ("ours", ["bench_replay.py"]),
    "published-core": ("published", ["bench_published.py"]),
    "published-latency": ("published", ["bench_latency.py", "--published", "--steps", "3"]),
}


def run_suite(names: list[str]) -> None:
    RESULTS.mkdir(exist_ok=True)
    for name in names:
        which, cmd = SUITE[name]
        python = sys.executable if which == "ours" else PUBLISHED_PYTHON
        if which == "published" and not os.path.exists(python):
            print(f"[report] skipping {name}: no published rgpu at {python}", file=sys.stderr)
            continue
        out = RESULTS / f"{name}.json"
        print(f"[report] {name}: {' '.join(cmd)}", file=sys.stderr, flush=True)
        subprocess.run(
            [python, str(HERE / cmd[0]), *cmd[1:], "--out", str(out)],
            check=True,
            cwd=REPO,
            stdout=subprocess.DEVNULL,
        )


def load(name: str) -> dict[str, Any] | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


# -- plots ---------------------------------------------------------------------------------------

MODE_LABEL = {
    "item": "eager, loss.item() every step",
    "nonblocking": "eager, non-blocking logging",
    "compiled": "compiled (graph shipping), non-blocking logging",
}


def plot_latency(
    lat: dict[str, Any], published: dict[str, Any] | None, plots: Path = PLOTS
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=120)
    ours = lat["ours"]
    for i, (mode, points) in enumerate(ours["modes"].items()):
        color = f"C{i}"
        rtts = [p["rtt_ms"] for p in points]
        ax.plot(rtts, [p["ms_per_step"] for p in points], "o-", color=color, label=MODE_LABEL[mode])
        if mode in ours["ideal"]:
            ax.plot(rtts, ours["ideal"][mode], "--", color=color, alpha=0.6,
                    label=f"ideal: compute + waits x RTT ({mode})")  # fmt: skip
    if published and published.get("item"):
        pts = published["item"]
        ax.plot([p["rtt_ms"] for p in pts], [p["ms_per_step"] for p in pts], "s-", color="C3",
                label=f"rgpu {published['version']} (PyPI), loss.item() every step")  # fmt: skip
    ax.set_xlabel("emulated round-trip time (ms)")
    ax.set_ylabel("training step (ms)")
    ax.set_title("TinyLM training step against link latency (CPU server, rgpu.netem)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = plots / "latency.png"
    fig.savefig(path)
    plt.close(fig)
    return path


# -- tables --------------------------------------------------------------------------------------


def _f(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{x:,.{digits}f}"


def _yes(flag: bool | None) -> str:
    return "–" if flag is None else ("yes" if flag else "**no**")


def section_core(core: dict[str, Any], pub: dict[str, Any] | None) -> list[str]:
    po, tr, mlp = core["per_op"], core["transfer"], core["mlp"]
    pp = pub or {}
    rows = [
        ("eager per-op cost (µs/op)", po["rgpu_us_per_op"]["median"], "≤ 15",
         po["meets_target"], pp.get("per_op", {}).get("rgpu_us_per_op", {}).get("median")),
        ("waits in a 5,000-op loop", po["waits"], "1", po["waits"] == 1,
         pp.get("per_op", {}).get("waits")),
        ("upload, 256 MiB (MB/s)", tr["upload_MBps"]["median"], "≥ 800",
         tr["upload_MBps"]["median"] >= 800, pp.get("transfer", {}).get("upload_MBps", {}).get("median")),
        ("download, 256 MiB (MB/s)", tr["download_MBps"]["median"], "≥ 800",
         tr["download_MBps"]["median"] >= 800,
         pp.get("transfer", {}).get("download_MBps", {}).get("median")),
        ("MLP training step (ms)", mlp["rgpu_ms_per_step"]["median"], "≤ 1.5", mlp["meets_target"],
         pp.get("mlp", {}).get("rgpu_ms_per_step", {}).get("median")),
        ("MLP messages per step", mlp["messages_per_step"], "–", None,
         pp.get("mlp", {}).get("messages_per_step")),
    ]  # fmt: skip
    out = [
        "## Device core (`bench_core.py`, `bench_published.py`)",
        "",
        "| benchmark | rgpu (this repo) | local baseline | target | met? | rgpu 0.1.1, same machine |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    local = {
        0: f"{po['local_us_per_op']['median']:.2f} µs/op (CPU torch)",
        2: f"{tr['loopback_socket_MBps']['median']:,.0f} MB/s (raw socket)",
        3: f"{tr['loopback_socket_MBps']['median']:,.0f} MB/s (raw socket)",
        4: f"{mlp['local_ms_per_step']['median']:.2f} ms (CPU torch)",
    }
    for i, (name, ours, target, met, theirs) in enumerate(rows):
        digits = 0 if "MB/s" in name or "waits" in name else 1 if "messages" in name else 2
        out.append(f"| {name} | {_f(ours, digits)} | {local.get(i, '–')} | {target} | "
                   f"{_yes(met)} | {_f(theirs, digits)} |")  # fmt: skip
    out += [
        "",
        f"Per-op client CPU {po['client_cpu_us_per_op']['median']:.1f} µs, server CPU "
        f"{po['server_cpu_us_per_op']['median']:.1f} µs; {po['bytes_out_per_op']:.0f} bytes per op "
        f"on the wire; {po['messages']:,} messages for the 5,000-op loop. Final MLP loss: rgpu "
        f"{mlp['final_loss_rgpu']:.6f}, local {mlp['final_loss_local']:.6f}.",
        "",
    ]
    ws = tr.get("websocket_only")
    if ws:
        out[-1:] = [
            "",
            "Transfers of 4 MiB or more use the bulk lane (raw bytes on a second connection; "
            "docs/protocol.md section 10). The same run, taking turns, with the lane off "
            f"(`RGPU_LANE=0`, the bytes as websocket frames): upload "
            f"{ws['upload_MBps']['median']:,.0f} MB/s, download "
            f"{ws['download_MBps']['median']:,.0f} MB/s (medians).",
            "",
        ]
    return out


def section_training(tr: dict[str, Any]) -> list[str]:
    lm = tr["lm"]
    return [
        "## Training (`bench_training.py`)",
        "",
        lm["workload"] + ".",
        "",
        "| | rgpu | local CPU torch | ratio (medians) | target | met? |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| TinyLM step (ms) | {lm['rgpu_ms_per_step']['median']:.1f} | "
        f"{lm['local_ms_per_step']['median']:.1f} | {lm['ratio_of_medians']:.2f}× | "
        f"≤ {lm['target_ratio']:.0f}× | {_yes(lm['meets_target'])} |",
        "",
        f"Per step: {lm['per_step']['messages']:.0f} messages, {lm['per_step']['waits']:.0f} "
        f"wait(s), {lm['per_step']['bytes_out'] / 1e3:.1f} kB out. Ratio per repeat: median "
        f"{lm['ratio_per_repeat']['median']:.2f}, best {lm['ratio_per_repeat']['min']:.2f}. "
        f"Client CPU {lm['client_cpu_ms_per_step']['median']:.1f} ms/step. Final loss: rgpu "
        f"{lm['final_loss_rgpu']:.5f}, local {lm['final_loss_local']:.5f}.",
        "",
    ]


def section_devices(dv: dict[str, Any]) -> list[str]:
    ddp, cp = dv["ddp"], dv["copies"]
    out = [
        "## Several devices (`bench_devices.py`)",
        "",
        "DistributedDataParallel with the `rgpu` c10d backend: N rank processes on rgpu:0..N-1 of "
        "one `rgpu-server --virtual-devices 4` (gloo on the server), an MLP 16-256-256-4, a "
        "global batch of 32 split across the ranks, `loss.item()` every step. Per client and "
        "step, after DDP's two set-up steps; every process shares the machine's cores, so the "
        "step time shows overhead and contention, not a speed-up.",
        "",
        "| devices | step (ms) | messages | waits | bytes out | bytes in | gradient bytes | "
        "gradients through the client? |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for world, w in ddp["worlds"].items():
        c = w["per_client_per_step"]
        out.append(
            f"| {world} | {w['ms_per_step']['median']:.1f} | {c['messages']:.0f} | "
            f"{c['waits']:.0f} | {c['bytes_out'] / 1e3:.1f} kB | {c['bytes_in']:.0f} B | "
            f"{ddp['gradient_bytes'] / 1e3:.0f} kB | "
            f"{'**yes**' if w['gradient_bytes_through_clients'] else 'no'} |"
        )
    names = {"same_device": "on its device (`clone`)",
             "other_device_same_server": "to another device of the same server",
             "other_server": "to another server (EXPORT/IMPORT over loopback)"}  # fmt: skip
    out += ["", f"Copies of {cp['bytes'] >> 20} MiB, taking turns (medians):", "",
            "| copy | MB/s | client bytes out / in |", "| --- | --- | --- |"]  # fmt: skip
    for k, v in cp["MBps"].items():
        moved = cp["client_bytes_per_copy"][k]
        out.append(f"| {names.get(k, k)} | {v['median']:,.0f} | "
                   f"{moved['bytes_out']} / {moved['bytes_in']} |")  # fmt: skip
    return out + [""]


def section_compile(cp: dict[str, Any]) -> list[str]:
    out = [
        "## Graph shipping (`bench_compile.py`)",
        "",
        "Steady state, the variants taking turns on one server (ms per step, median; messages "
        "and waits per step):",
        "",
        "| workload | variant | ms/step | messages/step | waits/step |",
        "| --- | --- | --- | --- | --- |",
    ]
    for workload, st in cp["steady"].items():
        for variant, ms in st["ms_per_step"].items():
            counts = st["per_step"].get(variant, {})
            out.append(f"| {workload} | {variant} | {ms['median']:.2f} | "
                       f"{_f(counts.get('messages'))} | {_f(counts.get('waits'), 2)} |")  # fmt: skip
    out += ["", "First training step in a fresh client process (seconds):", "",
            "| workload | variant | cold server | second client | new server, warm cache |",
            "| --- | --- | --- | --- | --- |"]  # fmt: skip
    warm = cp["warmup"]
    for workload, variants in warm["cold"].items():
        for variant, run in variants.items():
            second = warm.get("second_client", {}).get(workload, {}).get(variant)
            cached = warm.get("warm_cache", {}).get(workload, {}).get(variant)
            out.append(
                f"| {workload} | {variant} | {run['first_step_s']:.2f} | "
                f"{_f(second and second['first_step_s'], 2)} | "
                f"{_f(cached and cached['first_step_s'], 2)} |"
            )
    out.append("")
    return out


def section_latency(lat: dict[str, Any], pub: dict[str, Any] | None, plot: str) -> list[str]:
    ours = lat["ours"]
    modes = ours["modes"]
    rtts = [p["rtt_ms"] for p in next(iter(modes.values()))]
    head = " | ".join(f"{r:.0f} ms" for r in rtts)
    out = [
        "## Latency (`bench_latency.py`)",
        "",
        lat["workload"] + ". " + "Ideal = the mode's own 0 ms step + its waits per step × RTT.",
        "",
        f"![step time against RTT]({plot})",
        "",
        f"| ms per step at RTT | {head} | waits/step |",
        "| --- | " + " | ".join("---" for _ in rtts) + " | --- |",
    ]
    for mode, points in modes.items():
        cells = " | ".join(
            f"{p['ms_per_step']:.1f} (ideal {ideal:.1f})"
            for p, ideal in zip(points, ours["ideal"].get(mode, [None] * len(points)))
        )
        out.append(f"| {MODE_LABEL[mode]} | {cells} | {points[-1]['per_step']['waits']:.2f} |")
    if pub and pub.get("item"):
        cells = " | ".join(f"{p['ms_per_step']:.1f}" for p in pub["item"])
        out.append(f"| rgpu {pub['version']} (PyPI), loss.item() every step | {cells} | – |")
    elif pub:
        out.append(f"| rgpu {pub['version']} (PyPI) | could not run the workload: "
                   f"{pub.get('error')} |")  # fmt: skip
    out += ["", "Targets at 50 ms:", "", "| mode | rule | ms/step | limit | met? |",
            "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for mode, t in ours["targets_at_50ms"].items():
        out.append(f"| {MODE_LABEL[mode]} | {t['rule']} | {t['ms_per_step']:.1f} | "
                   f"{t['limit_ms']:.1f} | {_yes(t['met'])} |")  # fmt: skip
    out += ["", f"Losses agree with plain CPU torch: {_yes(ours.get('loss_matches_cpu'))}.", ""]
    comp = lat.get("compression_10mbit")
    if comp:
        out += ["### Op-stream compression at 10 Mbit/s", "",
                "The `item` loop through a 10 Mbit/s link (rgpu.netem), RGPU_COMPRESS=0 against =1:",
                "", "| RTT | compression | ms/step | kB out/step | compressed frames |",
                "| --- | --- | --- | --- | --- |"]  # fmt: skip
        for row in comp:
            out.append(f"| {row['rtt_ms']:.0f} ms | {'on' if row['compress'] else 'off'} | "
                       f"{row['ms_per_step']:.1f} | {row['per_step']['bytes_out'] / 1e3:.1f} | "
                       f"{row['compressed_frames']} |")  # fmt: skip
        out.append("")
    return out


def write_markdown(out: Path = REPO / "BENCHMARKS.md", plots: Path = PLOTS) -> Path:
    """BENCHMARKS.md (to `out`) and its plots (into `plots`) from benchmarks/results/."""
    core, pub_core = load("core"), load("published-core")
    training, compile_, lat, pub_lat = (
        load("training"), load("compile"), load("latency"), load("published-latency"))  # fmt: skip
    devices = load("devices")
    docs = [d for d in (core, training, compile_, lat, devices) if d]
    if not docs:
        raise SystemExit("no results in benchmarks/results/: run without --write-only first")
    m = docs[0]["machine"]
    more = [(name, load(name)) for name in ("hf", "files", "replay")]  # report_more's sections
    dates = sorted(
        d["date"] for d in docs + [d for d in (pub_core, pub_lat, *(d for _, d in more)) if d]
    )
    lines = [
        "# Benchmarks",
        "",
        "Written by `python benchmarks/report.py` from `benchmarks/results/*.json`; each number is "
        "a median over repeats in which rgpu and its baseline took turns, so the ratios hold up on "
        "a noisy shared machine.",
        "",
        f"- **Machine:** {m['cpu_count']} CPUs, {m['machine']}, {m['platform']}, Python "
        f"{m['python']}, torch {m['torch']} ({m['torch_threads']} threads); the server is the CPU "
        "server (`rgpu-server --device cpu`) on the same machine, over loopback, competing with "
        "the client for the cores. Since `0b38802` its kernels get every core but one (`--threads`"
        f" {max(1, m['cpu_count'] - 1)}, as the embedded server), leaving the client a core; "
        "results from an older commit (below) gave them every core. No GPU.",
        f"- **Date:** {dates[0]} to {dates[-1]} (UTC).",
        "- **Code:** "
        + ", ".join(
            f"{name} at `{d['machine'].get('repo_commit', '?')}`"
            for name, d in (("core", core), ("training", training), ("compile", compile_),
                            ("latency", lat), ("devices", devices), *more)
            if d and "machine" in d
        )
        + " (each with the working tree at the time).",
        "- **Published rgpu:** " + (
            "rgpu 0.1.1 from PyPI in its own virtualenv (it needs torch ≥ 2.14), same machine, "
            "same hour." if (pub_core or pub_lat) else "not measured in this run."),
        "",
    ]  # fmt: skip
    if core:
        lines += section_core(core, pub_core)
    if training:
        lines += section_training(training)
    if compile_:
        lines += section_compile(compile_)
    if lat:
        published = pub_lat and pub_lat.get("published")
        png = plot_latency(lat, published, plots)
        link = os.path.relpath(png, out.parent)
        lines += section_latency(lat, published, link)
    for name, section in (
        ("files", section_files),
        ("hf", section_hf),
        ("ab", section_ab),
        ("replay", section_replay),
    ):
        doc = load(name)
        if doc:
            lines += section(doc)
    if devices:
        lines += section_devices(devices)
    notes = HERE / "NOTES.md"
    if notes.exists():
        lines += [notes.read_text().rstrip(), ""]
    lines += [
        "## Reproduce",
        "",
        "```",
        "python benchmarks/report.py            # everything, then this file",
        *(f"python benchmarks/{' '.join(cmd)} --out benchmarks/results/{name}.json"
          for name, (which, cmd) in SUITE.items() if which == "ours"),
        *(f"{PUBLISHED_PYTHON} benchmarks/{' '.join(cmd)} --out benchmarks/results/{name}.json"
          for name, (which, cmd) in SUITE.items() if which == "published"),
        "```",
        "",
        f"_Generated {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC on "
        f"{platform.node() or 'this machine'}._",
        "",
    ]  # fmt: skip
    out.write_text("\n".join(lines))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--write-only", action="store_true", help="only rebuild BENCHMARKS.md")
    p.add_argument("--only", help="comma-separated subset of: " + ", ".join(SUITE))
    args = p.parse_args(argv)
    if not args.write_only:
        run_suite(args.only.split(",") if args.only else list(SUITE))
    print(write_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
