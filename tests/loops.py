"""Training loops shared by the reliability tests: deterministic, so a run that went through cuts
can be compared bit for bit with an uninterrupted one."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from rgpu.models import seed_mlp


def mlp_losses(steps: int, cut: Callable[[int], None] | None = None) -> list[float]:
    """The seed MLP trained on rgpu (SGD with momentum), with a chunked upload every step; `cut`
    runs mid-step, when the backward is queued but the optimizer step is not yet sent."""
    torch.manual_seed(0)
    model = seed_mlp().to("rgpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = torch.randn(64, 16).to("rgpu"), torch.randn(64, 1).to("rgpu")
    big = torch.randn(80_000)  # 320 KB: a chunked upload every step, which rides through cuts too
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y) + big.to("rgpu").mean() * 0
        loss.backward()
        if cut is not None:
            cut(step)
        opt.step()
        losses.append(loss.item())
    return losses
