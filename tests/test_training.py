"""Training on rgpu, rung by rung, each compared with the same run on the CPU.

Both sides start from identical weights (a deep copy) and identical data. A CPU server runs the
same kernels as local CPU torch, so differences come only from thread scheduling in reductions:
tolerances are stated per rung.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import rgpu
from rgpu.models import LSTMRegressor, SmallCNN, TinyLM, lm_batch, seed_mlp


def twin(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    return model, copy.deepcopy(model).to("rgpu")


def assert_params_close(remote: nn.Module, local: nn.Module, tol: float) -> None:
    for (name, r), c in zip(remote.named_parameters(), local.parameters()):
        torch.testing.assert_close(
            r.detach().cpu(), c.detach(), rtol=tol, atol=tol, msg=f"parameter {name}"
        )
        if c.grad is not None:
            torch.testing.assert_close(
                r.grad.cpu(), c.grad, rtol=tol, atol=tol, msg=f"gradient of {name}"
            )
    for (name, r), c in zip(remote.named_buffers(), local.buffers()):
        torch.testing.assert_close(r.cpu(), c, rtol=tol, atol=tol, msg=f"buffer {name}")


def train(model, opt, batches, loss_fn, device, read_every=1):
    losses = []
    for i, (x, y) in enumerate(batches):
        opt.zero_grad()
        loss = loss_fn(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        if i % read_every == 0:
            losses.append(loss.item())
    return losses


def test_seed_mlp_matches_cpu(dev):
    torch.manual_seed(0)
    cpu, remote = twin(seed_mlp())
    x, target = torch.randn(64, 16), torch.randn(64, 1)
    oc, orr = (
        torch.optim.SGD(cpu.parameters(), lr=0.01),
        torch.optim.SGD(remote.parameters(), lr=0.01),
    )
    mse = lambda out, t: (out - t).square().mean()  # noqa: E731
    lc = train(cpu, oc, [(x, target)] * 20, mse, "cpu")
    lr = train(remote, orr, [(x, target)] * 20, mse, dev)
    torch.testing.assert_close(torch.tensor(lr), torch.tensor(lc), rtol=1e-6, atol=1e-6)
    assert_params_close(remote, cpu, 1e-6)


@pytest.mark.parametrize("channels_last", [False, True])
def test_cnn_with_batchnorm_and_pooling_matches_cpu(dev, channels_last):
    torch.manual_seed(1)
    cpu, remote = twin(SmallCNN(channels_last=channels_last))
    g = torch.Generator().manual_seed(2)
    batches = [
        (torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 10, (8,), generator=g))
        for _ in range(4)
    ]
    oc = torch.optim.SGD(cpu.parameters(), lr=0.05, momentum=0.9)
    orr = torch.optim.SGD(remote.parameters(), lr=0.05, momentum=0.9)
    lc = train(cpu, oc, batches, F.cross_entropy, "cpu")
    lr = train(remote, orr, batches, F.cross_entropy, dev)
    torch.testing.assert_close(torch.tensor(lr), torch.tensor(lc), rtol=1e-5, atol=1e-5)
    assert_params_close(remote, cpu, 1e-4)  # includes BatchNorm running stats
    cpu.eval()
    remote.eval()
    x = batches[0][0]
    torch.testing.assert_close(remote(x.to(dev)).cpu(), cpu(x), rtol=1e-4, atol=1e-4)


def _lm(dropout=0.0):
    return TinyLM(vocab=65, width=64, heads=4, layers=2, context=32, dropout=dropout)


def test_transformer_lm_with_adamw_matches_cpu(dev):
    torch.manual_seed(3)
    cpu, remote = twin(_lm())
    g = torch.Generator().manual_seed(4)
    batches = [lm_batch(65, 4, 32, g)] * 5  # one batch, memorised: the loss must fall
    oc = torch.optim.AdamW(cpu.parameters(), lr=3e-3)
    orr = torch.optim.AdamW(remote.parameters(), lr=3e-3)
    lm_loss = lambda out, y: F.cross_entropy(out[0].flatten(0, 1), y.flatten())  # noqa: E731
    lc = train(cpu, oc, batches, lm_loss, "cpu")
    lr = train(remote, orr, batches, lm_loss, dev)
    torch.testing.assert_close(torch.tensor(lr), torch.tensor(lc), rtol=1e-5, atol=1e-5)
    assert lr[-1] < lr[0]
    assert_params_close(remote, cpu, 2e-4)


def test_lstm_and_gru_match_cpu(dev):
    torch.manual_seed(5)
    cpu, remote = twin(LSTMRegressor())
    g = torch.Generator().manual_seed(6)
    batches = [
        (torch.randn(4, 7, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(3)
    ]
    oc, orr = (
        torch.optim.Adam(cpu.parameters(), lr=1e-2),
        torch.optim.Adam(remote.parameters(), lr=1e-2),
    )
    lc = train(cpu, oc, batches, F.mse_loss, "cpu")
    lr = train(remote, orr, batches, F.mse_loss, dev)
    torch.testing.assert_close(torch.tensor(lr), torch.tensor(lc), rtol=1e-5, atol=1e-5)
    assert_params_close(remote, cpu, 1e-4)


def test_transformer_under_bf16_autocast(dev):
    torch.manual_seed(3)
    cpu, remote = twin(_lm())
    g = torch.Generator().manual_seed(4)
    batches = [lm_batch(65, 4, 32, g) for _ in range(5)]
    oc = torch.optim.AdamW(cpu.parameters(), lr=3e-3)
    orr = torch.optim.AdamW(remote.parameters(), lr=3e-3)
    losses_c, losses_r = [], []
    for x, y in batches:
        for model, opt, device, out in ((cpu, oc, "cpu", losses_c), (remote, orr, dev, losses_r)):
            opt.zero_grad()
            with torch.autocast(device, dtype=torch.bfloat16):
                logits, loss = model(x.to(device), y.to(device))
            if device == dev:
                assert logits.dtype == torch.bfloat16  # the head ran in bf16
                assert loss.dtype == torch.float32  # cross entropy ran in fp32
            loss.backward()
            opt.step()
            out.append(loss.item())
    # CPU autocast and rgpu autocast (CUDA's policy) cast slightly different op sets: bf16 tolerance
    torch.testing.assert_close(torch.tensor(losses_r), torch.tensor(losses_c), rtol=2e-2, atol=2e-2)
    for p in remote.parameters():
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32


def test_autocast_policies(dev):
    a = torch.randn(4, 4, device=dev)
    with torch.autocast("rgpu", dtype=torch.float16):
        assert (a @ a).dtype == torch.float16
        assert torch.log_softmax(a @ a, -1).dtype == torch.float32
        assert torch.relu(a.half()).dtype == torch.float16
        assert torch.addcmul(a.half(), a, a).dtype == torch.float32  # promote to the widest
        out = torch.empty(4, 4, device=dev)
        assert torch.mm(a, a, out=out) is out and out.dtype == torch.float32
        with pytest.raises(RuntimeError, match="binary_cross_entropy_with_logits"):
            F.binary_cross_entropy(torch.rand(3, device=dev), torch.rand(3, device=dev))
    assert (a @ a).dtype == torch.float32
    torch.testing.assert_close(F.binary_cross_entropy(torch.full((3,), 0.3, device=dev), torch.ones(3, device=dev)).cpu(),
                               F.binary_cross_entropy(torch.full((3,), 0.3), torch.ones(3)))  # fmt: skip


def test_grad_scaler_training_and_its_waits(dev):
    torch.manual_seed(7)
    model = seed_mlp().to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("rgpu")
    x, y = torch.randn(64, 16).to(dev), torch.randn(64, 1).to(dev)
    losses, waits = [], []
    for _ in range(6):
        before = rgpu.stats()["waits"]
        opt.zero_grad()
        with torch.autocast("rgpu", dtype=torch.float16):
            loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        waits.append(rgpu.stats()["waits"] - before)
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert waits[1:] == [1] * 5  # the scaler reads found_inf once per step (as on CUDA)


def test_a_step_costs_one_wait_with_item_and_none_without(dev):
    torch.manual_seed(8)
    model = _lm().to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = (t.to(dev) for t in lm_batch(65, 4, 32, torch.Generator().manual_seed(9)))

    def step():
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss

    step().item()  # warm up
    before = rgpu.stats()["waits"]
    step()
    assert rgpu.stats()["waits"] - before == 0
    step().item()
    assert rgpu.stats()["waits"] - before == 1


def test_autograd_features(dev):
    w = torch.randn(3, 3, device=dev, requires_grad=True)
    wc = w.detach().cpu().requires_grad_(True)
    for t in (w, wc):
        y = (t @ t).sin().sum()
        y.backward(retain_graph=True)
        y.backward()  # accumulates: twice the gradient
    torch.testing.assert_close(w.grad.cpu(), wc.grad)
    (g,) = torch.autograd.grad((w * w).sum(), w)
    torch.testing.assert_close(g.cpu(), 2 * wc.detach())
    with torch.no_grad():
        assert not (w * 2).requires_grad
    with torch.inference_mode():
        assert (w * 2).is_inference()
    assert not w.detach().requires_grad
    leaf = torch.ones(2, device=dev, requires_grad=True)
    (leaf * 3).sum().backward()
    assert torch.equal(leaf.grad.cpu(), torch.full((2,), 3.0))


@pytest.mark.parametrize(
    "make_module, make_input",
    [
        (lambda: nn.Conv1d(4, 6, 3, padding=1), lambda g: torch.randn(2, 4, 9, generator=g)),
        (lambda: nn.GroupNorm(2, 6), lambda g: torch.randn(3, 6, 5, generator=g)),
        (lambda: nn.LayerNorm(7), lambda g: torch.randn(3, 7, generator=g)),
        (lambda: nn.Embedding(10, 4), lambda g: torch.randint(0, 10, (3, 5), generator=g)),
        (
            lambda: nn.MultiheadAttention(8, 2, batch_first=True),
            lambda g: torch.randn(2, 5, 8, generator=g),
        ),
        (
            lambda: nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True),
            lambda g: torch.randn(2, 5, 8, generator=g),
        ),
        (lambda: nn.GRU(4, 6), lambda g: torch.randn(5, 2, 4, generator=g)),
        (
            lambda: nn.AvgPool2d(2),
            lambda g: torch.randn(1, 2, 6, 6, generator=g, requires_grad=True),
        ),
        (lambda: nn.BatchNorm1d(5).eval(), lambda g: torch.randn(4, 5, generator=g)),
    ],
)
def test_modules_forward_and_backward_match_cpu(dev, make_module, make_input):
    torch.manual_seed(10)
    cpu, remote = twin(make_module())
    x = make_input(torch.Generator().manual_seed(11))
    xr = x.detach().to(dev).requires_grad_(x.requires_grad)
    args_c = (x, x, x) if isinstance(cpu, nn.MultiheadAttention) else (x,)
    args_r = (xr, xr, xr) if isinstance(cpu, nn.MultiheadAttention) else (xr,)
    out_c, out_r = cpu(*args_c), remote(*args_r)
    out_c = out_c[0] if isinstance(out_c, tuple) else out_c
    out_r = out_r[0] if isinstance(out_r, tuple) else out_r
    torch.testing.assert_close(out_r.cpu(), out_c.detach(), rtol=1e-5, atol=1e-5)
    out_c.square().sum().backward()
    out_r.square().sum().backward()
    assert_params_close(remote, cpu, 1e-4)
    if x.requires_grad:
        torch.testing.assert_close(xr.grad.cpu(), x.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("loss_fn", [F.cross_entropy, F.nll_loss])
def test_classification_losses(dev, loss_fn):
    logits = torch.randn(6, 5).log_softmax(-1)
    target = torch.tensor([0, 4, 2, 2, 1, 3])
    torch.testing.assert_close(
        loss_fn(logits.to(dev), target.to(dev)).cpu(), loss_fn(logits, target)
    )


def test_optimizers_schedulers_and_zero_grad_both_ways(dev):
    for make_opt in (
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
        lambda p: torch.optim.Adam(p, lr=1e-2),
        lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    ):
        torch.manual_seed(12)
        cpu, remote = twin(seed_mlp())
        # rgpu takes the foreach path by default (as CUDA does); make the CPU take it too, since
        # SGD's foreach Nesterov update writes into .grad where the per-tensor loop does not
        oc, orr = make_opt(cpu.parameters()), make_opt(remote.parameters())
        for group in oc.param_groups:
            group["foreach"] = True
        sc, sr = (torch.optim.lr_scheduler.StepLR(o, 2, gamma=0.5) for o in (oc, orr))
        x, y = torch.randn(32, 16), torch.randn(32, 1)
        for i in range(5):
            for model, opt, sched, d in ((cpu, oc, sc, "cpu"), (remote, orr, sr, dev)):
                opt.zero_grad(set_to_none=(i % 2 == 0))
                F.mse_loss(model(x.to(d)), y.to(d)).backward()
                opt.step()
                sched.step()
        assert_params_close(remote, cpu, 1e-5)
        assert not remote[0].weight.grad.is_leaf or remote[0].weight.grad.device.type == "rgpu"


def test_foreach_is_the_default_optimizer_path(dev):
    from torch.optim.optimizer import _default_to_fused_or_foreach

    params = list(seed_mlp().to(dev).parameters())
    assert _default_to_fused_or_foreach(params, False, False) == (False, True)


def test_dropout_is_reproducible_and_matches_cpu(dev, session):
    def run(device):
        torch.manual_seed(13)
        model = _lm(dropout=0.2).to(device)
        for block in model.blocks:  # CPU attention draws its dropout inside a fused kernel
            block.attn.dropout = 0.0
        torch.manual_seed(13)  # the init drew from the CPU generator; start both streams equal
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(14)
        losses = []
        for _ in range(3):
            x, y = lm_batch(65, 4, 32, g)
            opt.zero_grad()
            _, loss = model(x.to(device), y.to(device))
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    first, second, cpu = run(dev), run(dev), run("cpu")
    assert first == second  # same seed, same masks, same losses, run after run
    if session.device == "cpu":  # a GPU's generator draws different masks than the CPU's
        torch.testing.assert_close(torch.tensor(first), torch.tensor(cpu), rtol=1e-5, atol=1e-5)


def test_rng_state_fork_rng_and_checkpoint_reproduce(dev):
    torch.manual_seed(15)
    state = torch.rgpu.get_rng_state()
    a = torch.rand(5, device=dev).cpu()
    torch.rgpu.set_rng_state(state)
    assert torch.equal(torch.rand(5, device=dev).cpu(), a)
    with torch.random.fork_rng(device_type="rgpu"):
        torch.rand(100, device=dev)
    b = torch.rand(5, device=dev).cpu()
    torch.rgpu.set_rng_state(state)
    torch.rand(5, device=dev)
    assert torch.equal(torch.rand(5, device=dev).cpu(), b)  # fork_rng restored the stream
    torch.rgpu.set_rng_state(state)
    with pytest.raises(TypeError, match="expected a torch.ByteTensor"):
        torch.rgpu.set_rng_state(state.float())  # cast by value, it was taken as a state
    assert torch.equal(torch.rand(5, device=dev).cpu(), a)  # and the stream is left as it was

    layer = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8)).to(dev)
    x = torch.randn(4, 8, device=dev, requires_grad=True)
    torch.manual_seed(16)
    plain = layer(x).sum()
    plain.backward()
    g_plain = x.grad.cpu()
    x.grad = None
    torch.manual_seed(16)
    ckpt = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False).sum()
    ckpt.backward()
    assert torch.equal(ckpt.detach().cpu(), plain.detach().cpu())
    assert torch.equal(x.grad.cpu(), g_plain)  # recomputation drew the same dropout mask


def test_checkpoint_round_trip_continues_identically(dev, tmp_path):
    def make():
        torch.manual_seed(17)
        model = seed_mlp().to(dev)
        return model, torch.optim.Adam(model.parameters(), lr=1e-2)

    x, y = torch.randn(32, 16).to(dev), torch.randn(32, 1).to(dev)

    def steps(model, opt, n):
        out = []
        for _ in range(n):
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            out.append(loss.item())
        return out

    model, opt = make()
    steps(model, opt, 3)
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
    uninterrupted = steps(model, opt, 4)

    fresh, fresh_opt = make()
    saved = torch.load(path)  # weights_only=True: the checkpoint holds plain CPU tensors
    assert saved["model"]["0.weight"].device.type == "cpu"
    fresh.load_state_dict(saved["model"])
    fresh_opt.load_state_dict(saved["opt"])
    assert fresh_opt.state[fresh_opt.param_groups[0]["params"][0]]["exp_avg"].device.type == "rgpu"
    assert steps(fresh, fresh_opt, 4) == uninterrupted


def test_moving_models(dev):
    model = seed_mlp()
    model(torch.randn(2, 16)).sum().backward()  # a grad-tracking forward on the CPU first
    model.to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    F.mse_loss(model(torch.randn(4, 16, device=dev)), torch.zeros(4, 1, device=dev)).backward()
    opt.step()
    assert all(p.device.type == "rgpu" for p in model.parameters())
    model.to("cpu")
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_dataloader_batches_move_without_waits(dev):
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.randn(64, 16), torch.randn(64, 1))
    model = seed_mlp().to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for pin in (False, True):
        loader = DataLoader(data, batch_size=16, pin_memory=pin)
        before = rgpu.stats()["waits"]
        for x, y in loader:
            if pin:
                assert x.is_pinned()
            opt.zero_grad()
            F.mse_loss(model(x.to(dev, non_blocking=True)), y.to(dev, non_blocking=True)).backward()
            opt.step()
        assert rgpu.stats()["waits"] == before


def test_pin_memory_works_and_feeds_uploads(dev):
    t = torch.arange(10.0)
    p = t.pin_memory()
    assert p.is_pinned() and not t.is_pinned()
    assert torch.equal(p.to(dev).cpu(), t)


def test_pinning_an_rgpu_tensor_is_refused_as_cuda_refuses_it(dev):
    x = torch.arange(4.0, device=dev)
    assert not x.is_pinned()
    with pytest.raises(RuntimeError, match="only dense CPU tensors can be pinned"):
        x.pin_memory()
    assert x.sum().item() == 6.0  # refused at the call: nothing reached the server


def test_sessions_have_their_own_random_streams(server, dev):
    import subprocess
    import sys
    import textwrap

    # another session reseeds and draws without pause from before our first draw until after
    # our last one (it stops when its stdin closes)
    noisy = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, threading, torch, rgpu
            rgpu.connect({server.url!r})
            stop = threading.Event()
            threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
            i = 0
            while not stop.is_set():
                torch.manual_seed(i)
                torch.rand(1000, device="rgpu").sum().item()
                i += 1
                if i == 1:
                    print("drawing", flush=True)
            print(i, flush=True)
        """)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert noisy.stdout.readline().strip() == "drawing"
        draws = []
        for _ in range(20):
            torch.manual_seed(99)
            draws.append(torch.rand(50, device=dev).cpu())
        noisy.stdin.close()
        assert int(noisy.stdout.readline()) > 1  # it was still drawing during ours
        torch.manual_seed(99)
        expected = torch.rand(50)
        assert all(torch.equal(d, expected) for d in draws)
    finally:
        noisy.kill()
        noisy.wait(timeout=120)
