"""Loading tensors where the data is: a safetensors file read on the server against uploading the
same tensors from the client, in the same run.

    python benchmarks/bench_files.py [--gib 1] [--repeats 3] [--out FILE.json]

Targets (issue 14): the load at least 3x faster than the upload on loopback, at least 1 GB/s from
the page cache, and at most 64 KiB on the wire per GiB loaded. The file (float32 tensors of
64 MiB) is written to a temporary data directory and read once before timing, so it is in the
page cache as a model a GPU host keeps on disk would be. Both paths are timed to the point the
tensors are usable on the server (`load_file` returns after the server has them; uploads are
followed by a synchronize), and again with one full read of every tensor on the server (a sum),
which on a CPU server is where a memory-mapped file's pages are first touched.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import doc_header, emit, log
from bench_core import start_server

import rgpu
import rgpu.files as rf

TENSOR_BYTES = 64 << 20


def _sync_sum(tensors: dict) -> None:
    total = None
    for t in tensors.values():
        s = t.sum()
        total = s if total is None else total + s
    total.item()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out")
    args = p.parse_args(argv)
    n = max(1, round(args.gib * (1 << 30) / TENSOR_BYTES))
    nbytes = n * TENSOR_BYTES
    with tempfile.TemporaryDirectory(prefix="rgpu-bench-files-") as tmp:
        from safetensors.torch import save_file

        host = {f"w{i}": torch.randn(TENSOR_BYTES // 4) for i in range(n)}
        save_file(host, Path(tmp) / "model.safetensors")
        with open(Path(tmp) / "model.safetensors", "rb") as f:  # into the page cache
            while f.read(64 << 20):
                pass
        rgpu.settings.progress_bytes = 0  # no progress bars in the timing
        proc, url = start_server(None, extra=["--data-dir", tmp])
        try:
            rgpu.connect(url)
            loads, loads_read, uploads, uploads_read, wire = [], [], [], [], []
            for r in range(args.repeats):
                before = rgpu.stats()
                t0 = time.perf_counter()
                loaded = rf.load_file("model.safetensors")
                loads.append(time.perf_counter() - t0)
                after = rgpu.stats()
                wire.append(after["bytes_in"] + after["bytes_out"] - before["bytes_in"]
                            - before["bytes_out"])  # fmt: skip
                _sync_sum(loaded)
                loads_read.append(time.perf_counter() - t0)
                del loaded
                torch.rgpu.synchronize()
                t0 = time.perf_counter()
                uploaded = {k: v.to("rgpu") for k, v in host.items()}
                torch.rgpu.synchronize()
                uploads.append(time.perf_counter() - t0)
                _sync_sum(uploaded)
                uploads_read.append(time.perf_counter() - t0)
                del uploaded
                torch.rgpu.synchronize()
                log(f"round {r}: load {nbytes / loads[-1] / 1e9:.2f} GB/s "
                    f"({nbytes / loads_read[-1] / 1e9:.2f} with a read), upload "
                    f"{nbytes / uploads[-1] / 1e9:.2f} GB/s ({nbytes / uploads_read[-1] / 1e9:.2f} "
                    f"with a read), {wire[-1]} bytes on the wire")  # fmt: skip
        finally:
            rgpu.disconnect()
            proc.terminate()
            proc.wait()
    load_s, load_read_s = statistics.median(loads), statistics.median(loads_read)
    up_s, up_read_s = statistics.median(uploads), statistics.median(uploads_read)
    doc = doc_header("files: load on the server vs upload", "rgpu (this repo)")
    doc.update(
        workload=f"{n} float32 tensors of 64 MiB ({nbytes / (1 << 30):.2f} GiB) in one safetensors "
        "file in the page cache, CPU server on this machine; median of the repeats",
        bytes=nbytes,
        load_gb_per_s=nbytes / load_s / 1e9,
        load_with_read_gb_per_s=nbytes / load_read_s / 1e9,
        upload_gb_per_s=nbytes / up_s / 1e9,
        upload_with_read_gb_per_s=nbytes / up_read_s / 1e9,
        load_over_upload_speed=up_s / load_s,
        load_over_upload_speed_with_read=up_read_s / load_read_s,
        wire_bytes_per_gib_loaded=statistics.median(wire) * (1 << 30) / nbytes,
        targets={
            "load_over_upload_speed": 3.0,
            "load_gb_per_s": 1.0,
            "wire_bytes_per_gib_loaded": 65536,
        },  # fmt: skip
        rounds={
            "load_s": loads,
            "load_with_read_s": loads_read,
            "upload_s": uploads,
            "upload_with_read_s": uploads_read,
            "wire_bytes": wire,
        },  # fmt: skip
    )
    emit(doc, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
