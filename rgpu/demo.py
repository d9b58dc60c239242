"""`python -m rgpu.demo`: a short tour on the embedded local server (or RGPU_SERVER if set)."""

from __future__ import annotations

import time

import torch

import rgpu


def main() -> None:
    session = rgpu.connect()
    print(f"connected to {session.url}: {session.device_name} (torch {session.server_torch})")

    x = torch.ones(4, device="rgpu")
    print("(x * 2).sum().item() =", (x * 2).sum().item())

    before = rgpu.stats()
    y = torch.zeros(16, device="rgpu")
    for _ in range(1000):
        y = y + 1
    total = y.sum().item()
    after = rgpu.stats()
    print(
        f"1000 ops then one .item() -> {total}: {after['messages'] - before['messages']} messages, "
        f"{after['waits'] - before['waits']} wait"
    )

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)
    ).to("rgpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data, target = torch.randn(64, 16).to("rgpu"), torch.randn(64, 1).to("rgpu")
    before = rgpu.stats()
    t0 = time.perf_counter()
    for step in range(100):
        optimizer.zero_grad()
        loss = (model(data) - target).square().mean()
        loss.backward()
        optimizer.step()
        if step % 25 == 0:
            print(f"  step {step:3d}  loss {loss.item():.4f}")
    final = loss.item()
    elapsed = time.perf_counter() - t0
    after = rgpu.stats()
    print(
        f"MLP: 100 SGD steps in {elapsed * 1e3:.0f} ms, final loss {final:.4f}, "
        f"{(after['messages'] - before['messages']) / 100:.0f} messages and "
        f"{(after['waits'] - before['waits']) / 100:.2f} waits per step"
    )
    rgpu.disconnect()


if __name__ == "__main__":
    main()
