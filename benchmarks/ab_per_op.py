"""Per-op cost and the MLP training step of two commits side by side (A/B), to tell a regression
from the machine's noise.

    python benchmarks/ab_per_op.py 92cb622 HEAD [--rounds 3] [--out FILE.json]

Each commit is checked out in a temporary git worktree. Rounds alternate between the two (A first, then B first): a
fresh process imports that tree's rgpu, starts its embedded CPU server, and times 7 repeats of
5,000 `x = x + 1` on 16 floats plus one `.item()` (wall time and client CPU time per op), then
5 repeats of 500 empty `torch.rgpu.synchronize()` (a round trip each, wall time), then
5 repeats of 200 steps of bench_core's MLP (Linear(16,32)-ReLU-Linear(32,1), batch 64, SGD, the
loss read every 10 steps), then (with transformers installed) bench_hf's Llama training step
(client CPU, wall and messages per step). The summary compares the medians of the best four (per-op) and best
three (MLP) repeats of each round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import doc_header, emit, log

REPO = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, sys, time
root = sys.argv[1]
sys.path[:0] = [root, root + "/server"]
import torch, rgpu
assert rgpu.__file__.startswith(root), rgpu.__file__
rgpu.connect("local")
x = torch.zeros(16, device="rgpu")
for _ in range(300):
    x = x + 1
x.sum().item()
time.sleep(1)
out = []
for _ in range(7):
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(5000):
        x = x + 1
    x.sum().item()
    out.append([(time.perf_counter() - t0) / 5000 * 1e6, (time.process_time() - c0) / 5000 * 1e6])
sync = []  # round trips: an empty synchronize() waits for the server's reply
for _ in range(5):
    t0 = time.perf_counter()
    for _ in range(500):
        torch.rgpu.synchronize()
    sync.append((time.perf_counter() - t0) / 500 * 1e6)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).to("rgpu")
opt = torch.optim.SGD(model.parameters(), lr=0.01)
xb, yb = torch.randn(64, 16).to("rgpu"), torch.randn(64, 1).to("rgpu")
def steps(n):
    for i in range(n):
        opt.zero_grad()
        loss = (model(xb) - yb).square().mean()
        loss.backward()
        opt.step()
        if (i + 1) % 10 == 0:
            loss.item()
steps(20)
mlp = []
for _ in range(5):
    t0 = time.perf_counter()
    steps(200)
    mlp.append((time.perf_counter() - t0) / 200 * 1e3)
llama = []
try:
    import transformers
except ImportError:
    transformers = None
if transformers is not None:  # bench_hf's Llama: client CPU, wall and messages per training step
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        num_hidden_layers=4, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=256, vocab_size=1000, max_position_embeddings=128,
    )
    lm = transformers.LlamaForCausalLM(cfg).to("rgpu")
    lopt = torch.optim.AdamW(lm.parameters(), lr=1e-3)
    ids = torch.randint(0, 1000, (4, 32), generator=torch.Generator().manual_seed(1)).to("rgpu")
    def lstep():
        lopt.zero_grad()
        loss = lm(input_ids=ids, labels=ids).loss
        loss.backward()
        lopt.step()
        return loss.item()
    for _ in range(3):
        lstep()
    for _ in range(5):
        m0, c0, t0 = rgpu.stats()["messages"], time.process_time(), time.perf_counter()
        for _ in range(4):
            lstep()
        llama.append([(time.process_time() - c0) / 4 * 1e3, (time.perf_counter() - t0) / 4 * 1e3,
                      (rgpu.stats()["messages"] - m0) / 4])
rgpu.disconnect()
print(json.dumps({"op": out, "sync_us": sync, "mlp_ms": mlp, "llama": llama}))
"""


def run_tree(root: str) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{root}:{root}/server"}  # the embedded server's code too
    out = subprocess.run(
        [sys.executable, "-c", CHILD, root],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        cwd=tempfile.gettempdir(),  # not the repo: its rgpu must not shadow the tree's
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out")
    args = p.parse_args(argv)
    trees: dict[str, str] = {}
    try:
        for rev in (args.a, args.b):
            path = tempfile.mkdtemp(prefix="rgpu-ab-")
            subprocess.run(["git", "worktree", "add", "-f", "--detach", path, rev], cwd=REPO,
                           check=True, capture_output=True)  # fmt: skip
            trees[rev] = path
        rounds: dict[str, list[dict]] = {rev: [] for rev in trees}
        for r in range(args.rounds):
            # the order flips every round: the second run of a round measured 5-20% slower
            # than the first on this machine whichever commit it was
            order = list(trees.items())
            for rev, path in order if r % 2 == 0 else order[::-1]:
                run = run_tree(path)
                rounds[rev].append(run)
                best = sorted(w for w, _ in run["op"])[:4]
                mlp = sorted(run["mlp_ms"])[:3]
                log(f"round {r} {rev}: {statistics.median(best):.1f} µs/op (best four, wall), "
                    f"MLP {statistics.median(mlp):.2f} ms/step (best three)")  # fmt: skip
        doc = doc_header("per-op and MLP A/B", "rgpu at two commits")
        doc["revisions"] = {}
        for rev, runs in rounds.items():
            walls = [statistics.median(sorted(w for w, _ in run["op"])[:4]) for run in runs]
            cpus = [statistics.median(sorted(c for _, c in run["op"])[:4]) for run in runs]
            mlps = [statistics.median(sorted(run["mlp_ms"])[:3]) for run in runs]
            syncs = [statistics.median(sorted(run["sync_us"])[:3]) for run in runs]
            doc["revisions"][rev] = {
                "wall_us_per_op_by_round": walls,
                "client_cpu_us_per_op_by_round": cpus,
                "median_wall_us_per_op": statistics.median(walls),
                "median_client_cpu_us_per_op": statistics.median(cpus),
                "mlp_ms_per_step_by_round": mlps,
                "median_mlp_ms_per_step": statistics.median(mlps),
                "sync_us_by_round": syncs,
                "median_sync_us": statistics.median(syncs),
            }
            if all(run.get("llama") for run in runs):  # transformers installed
                cpu_ms = [statistics.median(sorted(c for c, _, _ in run["llama"])[:3])
                          for run in runs]  # fmt: skip
                doc["revisions"][rev]["llama_client_cpu_ms_per_step_by_round"] = cpu_ms
                doc["revisions"][rev]["median_llama_client_cpu_ms_per_step"] = statistics.median(
                    cpu_ms
                )
                doc["revisions"][rev]["llama_messages_per_step"] = runs[0]["llama"][-1][2]
        revs = [doc["revisions"][rev] for rev in trees]
        if all("median_llama_client_cpu_ms_per_step" in r for r in revs):
            doc["llama_cpu_ratio_b_over_a"] = (
                revs[1]["median_llama_client_cpu_ms_per_step"]
                / revs[0]["median_llama_client_cpu_ms_per_step"]
            )
        doc["ratio_b_over_a"] = revs[1]["median_wall_us_per_op"] / revs[0]["median_wall_us_per_op"]
        doc["cpu_ratio_b_over_a"] = (
            revs[1]["median_client_cpu_us_per_op"] / revs[0]["median_client_cpu_us_per_op"]
        )
        doc["mlp_ratio_b_over_a"] = (
            revs[1]["median_mlp_ms_per_step"] / revs[0]["median_mlp_ms_per_step"]
        )
        doc["sync_ratio_b_over_a"] = revs[1]["median_sync_us"] / revs[0]["median_sync_us"]
        emit(doc, args.out)
    finally:
        for path in trees.values():
            subprocess.run(["git", "worktree", "remove", "--force", path], cwd=REPO,
                           capture_output=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
