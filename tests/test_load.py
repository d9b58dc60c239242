"""Many users at once on one server: correct results for each, and memory back to baseline."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import torch

import rgpu

CLIENT = """
    import sys, torch, rgpu
    import torch.nn.functional as F
    from rgpu.models import seed_mlp
    rgpu.connect(sys.argv[1])
    seed = int(sys.argv[2])

    def train(device):
        torch.manual_seed(seed)
        model = seed_mlp().to(device)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        x, y = torch.randn(64, 16).to(device), torch.randn(64, 1).to(device)
        drop = torch.nn.Dropout(0.3)
        torch.manual_seed(seed + 1000)  # the server draws dropout masks from this session's generator
        losses = []
        for _ in range(40):
            opt.zero_grad()
            loss = F.mse_loss(model(drop(x)), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    remote, local = train("rgpu"), train("cpu")
    print("OK" if remote == local else f"MISMATCH {remote[:3]} {local[:3]}", flush=True)
"""


def test_eight_clients_training_at_once_all_match_their_cpu_reference(start_server):
    srv = start_server("--session-grace", "2")
    rgpu.connect(srv.url)
    baseline = rgpu.session_info()["server"]
    clients = [
        subprocess.Popen([sys.executable, "-c", textwrap.dedent(CLIENT), srv.url, str(seed)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for seed in range(8)
    ]  # fmt: skip
    outputs = [c.communicate(timeout=600) for c in clients]
    for (out, err), c in zip(outputs, clients):
        assert c.returncode == 0, err
        assert out.strip() == "OK", out + err
    time.sleep(3)  # past the grace period: nothing of the eight may be left
    after = rgpu.session_info()["server"]
    assert (after["sessions"], after["tensors"], after["bytes"]) == (
        baseline["sessions"],
        baseline["tensors"],
        baseline["bytes"],
    )


def test_ten_thousand_training_steps_do_not_grow_the_server(server):
    rgpu.connect(server.url)
    from rgpu.models import seed_mlp

    model = seed_mlp().to("rgpu")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    x, y = torch.randn(64, 16).to("rgpu"), torch.randn(64, 1).to("rgpu")
    counts = []
    for step in range(10_000):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if step % 2000 == 1999:
            info = rgpu.session_info()
            counts.append((info["tensors"], info["bytes"]))
    assert len(set(counts)) == 1, counts  # the same tensors and bytes after 2k, 4k, ... 10k steps
    assert loss.item() < 10
