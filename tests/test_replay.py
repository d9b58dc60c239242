"""Replayed steps, end to end: a repeated op sequence goes to the server once and each later
repetition is one REPLAY message per `flush_ops` ops, with the same results and the same errors
as sending every op, and with nothing for the user to change.

The server here runs on one thread (and so does the client's torch while a test compares with
it), so rgpu's results can be compared with local CPU torch bit for bit.
"""

from __future__ import annotations

import _thread
import copy
import random
import signal
import threading

import pytest
import torch
import torch.nn.functional as F

import rgpu
from rgpu.models import TinyLM, lm_batch, seed_mlp

pytestmark = pytest.mark.usefixtures("replay_on")


@pytest.fixture
def sess(one_thread):
    return rgpu.connect(one_thread.url)


def replaying(on: bool) -> None:
    rgpu.settings.replay = on


def lm_training(device: str, steps: int = 7, dropout: float = 0.1) -> tuple[list, list]:
    torch.manual_seed(3)
    model = TinyLM(vocab=65, width=32, heads=2, layers=2, context=16, dropout=dropout).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)  # its step sizes change every step
    torch.manual_seed(5)  # dropout's draws: the same on the CPU and in the server's session
    g = torch.Generator().manual_seed(4)
    losses = []
    for _ in range(steps):
        x, y = lm_batch(65, 4, 16, g)
        opt.zero_grad()
        _, loss = model(x.to(device), y.to(device))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().cpu() for p in model.parameters()]


def test_training_replayed_equals_op_by_op_and_the_cpu(sess):
    cpu_losses, cpu_params = lm_training("cpu")
    replaying(False)
    before = rgpu.stats()
    plain_losses, plain_params = lm_training("rgpu")
    plain = {k: rgpu.stats()[k] - before[k] for k in before}
    replaying(True)
    before = rgpu.stats()
    losses, params = lm_training("rgpu")
    replayed = {k: rgpu.stats()[k] - before[k] for k in before}
    assert losses == plain_losses == cpu_losses
    assert all(torch.equal(a, b) and torch.equal(a, c)
               for a, b, c in zip(params, plain_params, cpu_params))  # fmt: skip
    assert plain["replayed_ops"] == 0 and replayed["replayed_ops"] > 3 * 80
    assert replayed["messages"] < plain["messages"] - 3 * 70
    assert replayed["waits"] == plain["waits"]  # a replay adds no wait


def test_a_replayed_step_is_one_message_in_place_of_its_ops(sess):
    """The seed MLP with SGD: every step after the third is one REPLAY (plus its wait)."""

    def steps(n: int) -> list[dict]:
        torch.manual_seed(0)
        model = seed_mlp().to("rgpu")
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        x, y = torch.randn(64, 16).to("rgpu"), torch.randn(64, 1).to("rgpu")
        torch.rgpu.synchronize()
        out = []
        for _ in range(n):
            before = rgpu.stats()
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
            torch.rgpu.synchronize()
            out.append({k: rgpu.stats()[k] - before[k] for k in before})
        return out

    replaying(False)
    plain = steps(6)
    replaying(True)
    replayed = steps(6)
    assert [s["replayed_ops"] for s in replayed[:3]] == [0, 0, 0]  # seen twice, then sent once
    for p, r in zip(plain[3:], replayed[3:]):
        ops = r["replayed_ops"]
        assert ops == p["messages"] - 2  # every RUN of the step (the rest: a FREE and the SYNC)
        define = 1 if r is replayed[3] else 0
        assert r["messages"] == p["messages"] - ops + 1 + define
        assert r["bytes_out"] < p["bytes_out"] or define


def test_a_transformers_gpt2_trains_the_same_replayed(sess):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=200,
                                     n_positions=32)  # fmt: skip
    torch.manual_seed(0)
    cpu_model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(1))

    def train(device: str) -> tuple[list, list]:
        model = copy.deepcopy(cpu_model).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        torch.manual_seed(5)  # dropout draws: the session generator on rgpu
        losses = []
        for _ in range(6):
            loss = model(input_ids=ids.to(device), labels=ids.to(device)).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, [p.detach().cpu() for p in model.parameters()]

    replaying(False)
    plain = train("rgpu")
    replaying(True)
    ops0 = rgpu.stats()["replayed_ops"]
    replayed = train("rgpu")
    assert rgpu.stats()["replayed_ops"] - ops0 > 3 * 100
    assert replayed[0] == plain[0]
    assert all(torch.equal(a, b) for a, b in zip(replayed[1], plain[1]))
    cpu = train("cpu")
    torch.testing.assert_close(torch.tensor(replayed[0]), torch.tensor(cpu[0]), rtol=0, atol=0)


def failing_steps(bad_step: int, sites: bool = False) -> tuple[list, Exception, Exception]:
    """Steps whose gather and index_add_ read an uploaded index; at `bad_step` it is out of
    range, inside what is by then a replayed step."""
    rgpu.settings.op_sites = sites
    src = torch.arange(10.0, device="rgpu")
    acc = torch.zeros(10, device="rgpu")
    values, error = [], None
    for step in range(6):
        idx = torch.tensor([1, 2, 3 if step != bad_step else 99]).to("rgpu")
        picked = torch.gather(src, 0, idx)  # the op that fails
        scaled = (picked * 2 + 1).relu()
        acc.index_add_(0, idx, scaled)  # an in-place op on what failed
        total = (scaled.sum() + acc.sum()) * 0.5
        try:
            values.append(total.item())
        except rgpu.RemoteError as e:
            error = e
    with pytest.raises(rgpu.RemoteError) as again:
        acc.sum().item()  # the tensor the failed in-place op writes stays poisoned
    return values, error, again.value


def test_a_failure_inside_a_replay_poisons_and_reports_as_op_by_op(sess):
    replaying(False)
    plain_values, plain_error, plain_again = failing_steps(4)
    replaying(True)
    ops0 = rgpu.stats()["replayed_ops"]
    values, error, again = failing_steps(4, sites=True)
    assert rgpu.stats()["replayed_ops"] - ops0 > 10  # the failing step was a replayed one
    assert values == plain_values and len(values) == 4  # acc stays poisoned after step 4
    assert (error.op, error.remote_message) == (plain_error.op, plain_error.remote_message)
    assert error.op == "aten::gather.default" and "index" in error.remote_message
    assert (again.op, again.remote_message) == (plain_again.op, plain_again.remote_message)
    assert "picked = torch.gather(src, 0, idx)" in _line_of(error)


def _line_of(error: rgpu.RemoteError) -> str:
    """The source line an error's site names ("test_replay.py, line N")."""
    assert error.site is not None and "test_replay.py" in error.site, error.site
    line = int(error.site.rsplit(" ", 1)[1])
    with open(__file__, encoding="utf-8") as f:
        return f.read().splitlines()[line - 1]


def test_a_step_that_changes_midway_is_sent_as_it_is_from_there(sess):
    def run() -> list[float]:
        w = torch.linspace(0, 1, 32, device="rgpu")
        out = []
        for step in range(9):
            h = (w * 3).sin()
            if step in (5, 7):
                h = h * 2  # this step differs from the template after a few ops
            h = (h + w).cos().exp()
            w = w + h.mean() * 0.01
            out.append(h.sum().item())
        return out

    replaying(False)
    plain = run()
    replaying(True)
    sess.replay.fallbacks = 0
    ops0 = rgpu.stats()["replayed_ops"]
    assert run() == plain
    assert sess.replay.fallbacks == 2
    assert rgpu.stats()["replayed_ops"] - ops0 >= 4 * 6  # steps 3, 4, 6 and 8 at least


def test_floats_that_change_are_parameters_and_a_new_one_is_learned(sess):
    def run() -> list[float]:
        w = torch.ones(8, device="rgpu")
        out = []
        for step in range(12):
            lr = 0.1 if step < 6 else 0.05  # a schedule: fixed for six steps, then changes
            w = w - lr * (w * (1.0 + step / 10)).tanh()  # and a float that changes every step
            w = w.clamp(-2, 2).add(0.25).mul(0.5).sub(0.125).abs().sqrt()
            out.append(w.sum().item())
        return out

    replaying(False)
    plain = run()
    replaying(True)
    ops0 = rgpu.stats()["replayed_ops"]
    assert run() == plain
    steps = (rgpu.stats()["replayed_ops"] - ops0) // 10
    assert steps >= 6  # steps 3-5 replayed, 6 relearned the schedule's float, 7-11 replayed


def test_segments_with_many_frees_replay_and_free_on_the_server(sess):
    def run() -> float:
        x = torch.zeros(16, device="rgpu")
        for _ in range(3000):  # frees go out every 1024 ids, cutting the replay into parts
            x = x + 1
        return x.sum().item()

    ops0 = rgpu.stats()["replayed_ops"]
    assert [run() for _ in range(4)] == [16.0 * 3000] * 4
    assert rgpu.stats()["replayed_ops"] - ops0 == 2 * 3002  # with zeros and sum
    assert rgpu.session_info()["tensors"] < 200  # every freed id was dropped


def test_a_train_step_and_an_eval_step_with_the_same_first_op_both_replay(sess):
    torch.manual_seed(0)
    model = seed_mlp().to("rgpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 16).to("rgpu")
    out = []
    ops = []
    for step in range(16):
        before = rgpu.stats()["replayed_ops"]
        if step % 2:
            with torch.no_grad():  # its linears go whole: more ops after them, to replay
                out.append((model(x * 2).relu() + 1).square().mean().sum().item())
        else:
            opt.zero_grad()
            loss = model(x * 2).square().mean()
            loss.backward()
            opt.step()
            out.append(loss.item())
        ops.append(rgpu.stats()["replayed_ops"] - before)
    assert all(n > 0 for n in ops[-6:]), ops  # both kinds of step replay once learned


def test_replay_by_environment_and_by_setting(one_thread, monkeypatch):
    rgpu.settings.replay = None
    monkeypatch.delenv("RGPU_REPLAY", raising=False)
    rgpu.connect(one_thread.url)  # off by default
    assert [mlp_steps() for _ in range(5)][-1] == mlp_steps()
    assert rgpu.stats()["replayed_ops"] == 0
    monkeypatch.setenv("RGPU_REPLAY", "0")
    rgpu.connect(one_thread.url)
    rgpu.settings.replay = True  # the setting wins over the environment
    for _ in range(5):
        mlp_steps()
    assert rgpu.stats()["replayed_ops"] > 0
    monkeypatch.setenv("RGPU_REPLAY", "1")
    rgpu.connect(one_thread.url)
    rgpu.settings.replay = False
    for _ in range(5):
        mlp_steps()
    assert rgpu.stats()["replayed_ops"] == 0
    rgpu.settings.replay = None  # back to the session's RGPU_REPLAY: on
    for _ in range(5):
        mlp_steps()
    assert rgpu.stats()["replayed_ops"] > 0


def mlp_steps() -> float:
    torch.manual_seed(0)
    model = seed_mlp().to("rgpu")
    x = torch.randn(8, 16).to("rgpu")
    for _ in range(2):
        (model(x) * 0.5).relu().sum().backward()
    return model[0].weight.grad.sum().item()


def sgd_losses(steps: int) -> list[float]:
    """The seed MLP trained with SGD, no upload inside a step (a chunked upload every step, as
    tests/loops.py has, could not get through cuts this close together)."""
    torch.manual_seed(0)
    model = seed_mlp().to("rgpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = torch.randn(64, 16).to("rgpu"), torch.randn(64, 1).to("rgpu")
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        losses.append(F.mse_loss(model(x), y).item())
    return losses


def test_dropped_connections_during_replayed_steps_change_nothing(server, proxied):
    rgpu.connect(server.url)
    clean = sgd_losses(12)
    rng = random.Random(17)
    proxy = proxied(cut_budget=lambda: rng.randint(3_000, 40_000))
    session = rgpu.connect(proxy.url)
    while session.reconnects < 8:
        assert sgd_losses(12) == clean
    assert session.stats()["replayed_ops"] > 100


@pytest.fixture
def sigint():
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def test_an_interrupt_cancels_the_replayed_ops_the_server_has_not_started(sess, sigint):
    x = torch.randn(256, 256, device="rgpu")

    def step() -> list:
        ys = [x @ x for _ in range(600)]
        return ys

    for _ in range(3):
        step()
        torch.rgpu.synchronize()
    before = rgpu.session_info()["ops_run"]
    ops0 = rgpu.stats()["replayed_ops"]
    ys = step()  # replayed
    timer = threading.Timer(0.1, _thread.interrupt_main)
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        torch.rgpu.synchronize()
    timer.join()
    assert rgpu.stats()["replayed_ops"] - ops0 == 600
    ran = rgpu.session_info()["ops_run"] - before
    assert ran < 600
    with pytest.raises(rgpu.RemoteError, match="cancelled: an interrupt"):
        ys[-1].cpu()
    assert torch.equal((x + 1).cpu(), x.cpu() + 1)


def test_compiled_stretches_give_what_the_loop_gives(sess, start_server):
    """The server runs stretches of plain ops as generated code (RGPU_REPLAY_COMPILED, on by
    default); off, every op goes through the loop: training, a failure midway and what it
    poisons are the same either way, and the same as RUNs."""
    results = {}
    for compiled in ("1", "0"):
        srv = start_server("--threads", "1", env={"RGPU_REPLAY_COMPILED": compiled})
        rgpu.connect(srv.url)
        replaying(True)
        ops0 = rgpu.stats()["replayed_ops"]
        losses, params = lm_training("rgpu", dropout=0.0)
        values, error, again = failing_steps(4)
        assert rgpu.stats()["replayed_ops"] - ops0 > 100
        results[compiled] = (losses, params, values, error.remote_message, again.remote_message)
        rgpu.disconnect()
    on, off = results["1"], results["0"]
    assert on[0] == off[0] and all(torch.equal(a, b) for a, b in zip(on[1], off[1]))
    assert on[2:] == off[2:] and len(on[2]) == 4
    assert on[0] == lm_training("cpu", dropout=0.0)[0]
