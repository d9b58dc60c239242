"""Replayed steps across the session's other features: exact message kinds per step, a changed
step falling back to RUNs, several sessions on one server, a named session re-opened, compiled
graphs and a Hugging Face decode loop; each against replay off or the CPU.

The server here runs on one thread (and so does the client's torch while a test compares with
it), so rgpu's results can be compared with local CPU torch bit for bit.
"""

from __future__ import annotations

import collections
import copy
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import rgpu
from rgpu.models import TinyLM, lm_batch, seed_mlp
from rgpu_protocol import Kind

pytestmark = pytest.mark.usefixtures("replay_on")


@pytest.fixture
def sess(one_thread):
    return rgpu.connect(one_thread.url)


def count_kinds(session, monkeypatch) -> collections.Counter:
    """Kinds of the messages `session` queues from now on (every message is encoded once)."""
    kinds: collections.Counter = collections.Counter()
    encode = session._encode

    def spy(msg):
        kinds[Kind(msg[0]).name] += 1
        return encode(msg)

    monkeypatch.setattr(session, "_encode", spy)
    return kinds


def mlp_step(model, opt, x, y) -> float:
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()


def test_after_warm_up_each_step_is_replays_and_a_wait_and_no_run(sess, monkeypatch):
    torch.manual_seed(0)
    model = seed_mlp().to("rgpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # step sizes change every step
    x, y = torch.randn(64, 16).to("rgpu"), torch.randn(64, 1).to("rgpu")
    for _ in range(4):  # AdamW's first step makes its state: steps 2 and 3 make the template
        mlp_step(model, opt, x, y)
    kinds = count_kinds(sess, monkeypatch)
    ops0 = rgpu.stats()["replayed_ops"]
    steps = 10
    for _ in range(steps):
        mlp_step(model, opt, x, y)
    per_step = (rgpu.stats()["replayed_ops"] - ops0) / steps
    assert per_step >= 15 and per_step == int(per_step)
    assert kinds["RUN"] == 0 and kinds["DEFINE"] == 0
    assert kinds["REPLAY"] == steps * -(-int(per_step) // sess.config.flush_ops)
    assert kinds["DOWNLOAD"] == steps  # each loss.item(), the step's one wait
    assert set(kinds) <= {"REPLAY", "DOWNLOAD", "FREE"}, kinds


def cpu_and_rgpu(fn) -> tuple:
    rgpu.settings.replay = False
    plain = fn("rgpu")
    rgpu.settings.replay = True
    replayed = fn("rgpu")
    return fn("cpu"), plain, replayed


def test_a_batch_of_another_shape_falls_back_to_runs_and_is_learned_too(sess, monkeypatch):
    def run(device: str) -> list[float]:
        torch.manual_seed(0)
        model = seed_mlp().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        gen = torch.Generator().manual_seed(2)
        data = {n: (torch.randn(n, 16, generator=gen), torch.randn(n, 1, generator=gen))
                for n in (64, 48)}  # fmt: skip
        data = {n: (a.to(device), b.to(device)) for n, (a, b) in data.items()}
        # 64-row steps, then one 48-row step (the last batch of an epoch), and again
        sizes = [64] * 5 + [48] + [64] * 3 + [48] + [64] * 2 + [48] * 3
        return [mlp_step(model, opt, *data[n]) for n in sizes]

    cpu, plain, replayed = cpu_and_rgpu(run)
    assert replayed == plain == cpu
    kinds = count_kinds(sess, monkeypatch)
    sess.replay.fallbacks = 0
    assert run("rgpu") == plain
    assert kinds["REPLAY"] > 0 and kinds["RUN"] > 0


def test_a_branch_taken_differently_is_sent_as_runs_and_stays_correct(sess, monkeypatch):
    def run(device: str) -> list[float]:
        w = torch.linspace(-1, 1, 64, device=device)
        out = []
        for step in range(12):
            h = (w * 2).tanh().add(0.5).mul(w).sin().exp().sub(1).abs().sqrt()
            h = h.relu() if step % 4 == 3 else h.sigmoid()  # every fourth step: the other branch
            w = w - 0.01 * h.mean()
            out.append(h.sum().item())
        return out

    sess.replay.fallbacks = 0
    cpu, plain, replayed = cpu_and_rgpu(run)
    assert replayed == plain == cpu
    assert sess.replay.fallbacks >= 2  # the other branch, until it is learned too
    assert run("rgpu") == plain  # the first step's segment (with linspace) is learned too
    kinds = count_kinds(sess, monkeypatch)
    assert run("rgpu") == plain
    assert kinds["REPLAY"] == 12 and kinds["RUN"] == 0, kinds  # both branches replay now


SCALED = """
import json, sys, torch, rgpu
rgpu.connect(sys.argv[1])
def run(dev, scale):
    w = torch.linspace(0, 1, 32, device=dev)
    out = []
    for _ in range(8):
        w = (w * scale).sin().add(1).log().mul(0.5).add(w).tanh().mul(2).sub(0.1)
        out.append(w.sum().item())
    return out
if __name__ == "__main__":
    torch.set_num_threads(1)
    print(json.dumps([run("rgpu", float(sys.argv[2])) for _ in range(4)]), flush=True)
    print(rgpu.stats()["replayed_ops"], flush=True)
"""


def test_two_sessions_on_one_server_keep_their_own_sequences(one_thread, tmp_path):
    script = tmp_path / "scaled.py"
    script.write_text(SCALED)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "RGPU_REPLAY": "1"}
    runs = [subprocess.Popen([sys.executable, str(script), one_thread.url, scale], env=env,
                             stdout=subprocess.PIPE, text=True) for scale in ("1.5", "0.5")]  # fmt: skip
    outs = [p.communicate(timeout=120)[0].splitlines() for p in runs]
    rgpu.connect(one_thread.url)
    namespace: dict = {}
    exec(SCALED.replace("rgpu.connect(sys.argv[1])", ""), namespace)
    rgpu.settings.replay = False
    for (values, replayed), scale in zip(outs, (1.5, 0.5)):
        plain = namespace["run"]("rgpu", scale)
        assert json.loads(values) == [plain] * 4  # at the same time, on one server, replayed
        assert int(replayed) > 2 * 8 * 8
        assert plain == namespace["run"]("cpu", scale)


def test_a_reopened_named_session_defines_its_sequences_again(one_thread):
    torch.manual_seed(0)
    base = seed_mlp()
    batch = (torch.randn(32, 16), torch.randn(32, 1))
    cpu_model = copy.deepcopy(base)
    cpu_opt = torch.optim.Adam(cpu_model.parameters(), lr=0.01)
    cpu = [mlp_step(cpu_model, cpu_opt, *batch) for _ in range(12)]

    session = rgpu.connect(one_thread.url, session="replay-reopen")
    model = copy.deepcopy(base).to("rgpu")
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    batch = tuple(t.to("rgpu") for t in batch)
    first = [mlp_step(model, opt, *batch) for _ in range(6)]
    assert session.replay.replayed_ops > 0
    rgpu.keep("model", model)
    rgpu.keep("opt", opt)
    rgpu.keep("batch", list(batch))
    rgpu.connect(one_thread.url)  # leaves it detached
    again = rgpu.connect(one_thread.url, session="replay-reopen")
    model = copy.deepcopy(base)
    model.load_state_dict(rgpu.kept("model"), assign=True)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    opt.load_state_dict(rgpu.kept("opt"))
    batch = rgpu.kept("batch")
    second = [mlp_step(model, opt, *batch) for _ in range(6)]
    assert again.replay.defines >= 1 and again.replay.replayed_ops > 0
    assert first + second == cpu
    rgpu.disconnect(drop=True)


def test_compiled_steps_train_the_same_with_replay_on(sess):
    torch._dynamo.reset()

    def run(device: str) -> list[float]:
        torch.manual_seed(0)
        model = TinyLM(vocab=65, width=32, heads=2, layers=1, context=16, dropout=0.0).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        step = torch.compile(model, backend=rgpu.compile_backend(compiler="eager"), dynamic=False)
        g = torch.Generator().manual_seed(4)
        losses = []
        for _ in range(6):
            x, y = lm_batch(65, 4, 16, g)
            opt.zero_grad()
            _, loss = step(x.to(device), y.to(device)) if device != "cpu" else model(x, y)
            loss.backward()
            opt.step()  # eager AdamW after the shipped graphs: its ops replay
            losses.append(loss.item())
        return losses

    rgpu.settings.replay = False
    plain = run("rgpu")
    torch._dynamo.reset()
    rgpu.settings.replay = True
    ops0 = rgpu.stats()["replayed_ops"]
    replayed = run("rgpu")
    torch._dynamo.reset()
    assert replayed == plain
    assert rgpu.stats()["replayed_ops"] > ops0
    torch.testing.assert_close(torch.tensor(replayed), torch.tensor(run("cpu")), rtol=0, atol=0)


def test_a_transformers_decode_loop_gives_the_same_tokens_replayed(sess):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=300, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    cpu_model = transformers.LlamaForCausalLM(config).eval()
    prompt = torch.tensor([[5, 17, 3, 42, 8, 1]])

    def greedy(device: str) -> list[int]:
        model = copy.deepcopy(cpu_model).to(device)
        out = model.generate(prompt.to(device), max_new_tokens=12, min_new_tokens=12,
                             do_sample=False, pad_token_id=0)  # fmt: skip
        return out.cpu().tolist()

    def manual(device: str) -> list[int]:  # a hand-written loop over the KV cache
        model = copy.deepcopy(cpu_model).to(device)
        ids = prompt.to(device)
        out = model(input_ids=ids, use_cache=True)
        tokens = []
        for _ in range(12):
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(nxt)
            out = model(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
        return torch.cat(tokens, 1).cpu().tolist()

    for loop in (greedy, manual):
        cpu, plain, replayed = cpu_and_rgpu(loop)
        assert replayed == plain == cpu
    # a dynamic KV cache grows each token: the views into it differ from token to token, so
    # little of a decode step repeats byte for byte (what does is replayed)


def test_a_loop_that_never_waits_replays_step_by_step(sess, monkeypatch):
    """No wait and no upload inside the loop (the advice): optimizer.step() ends each step."""

    def run(device: str) -> list[float]:
        torch.manual_seed(0)
        model = seed_mlp().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        x, y = torch.randn(64, 16).to(device), torch.randn(64, 1).to(device)
        total = torch.zeros((), device=device)
        for _ in range(40):
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            total += loss.detach()
        return [total.item()]

    ops0 = rgpu.stats()["replayed_ops"]
    cpu, plain, replayed = cpu_and_rgpu(run)
    assert replayed == plain == cpu
    assert rgpu.stats()["replayed_ops"] - ops0 > 30 * 15


def test_an_internal_error_turns_replay_off_and_loses_no_op(sess, monkeypatch, caplog):
    def run(device: str) -> list[float]:
        w = torch.linspace(0, 1, 32, device=device)
        out = []
        for _ in range(8):
            w = (w * 1.5).sin().add(1).log().mul(0.5).add(w).tanh().mul(2).sub(0.1)
            out.append(w.sum().item())
        return out

    cpu, plain, _ = cpu_and_rgpu(run)
    replayer = sess.replay
    for when in ("before", "after"):  # the op not yet held, or held already
        rgpu.settings.replay = True  # again: the first failure turned it off
        calls = {"n": 0}
        take = type(replayer).take

        def flaky(msg, when=when, calls=calls, take=take):
            calls["n"] += 1
            fail = calls["n"] == 30  # mid-way through a replayed step (the third), ops held
            if fail and when == "before":
                raise AssertionError("a bug in replaying")
            held = take(replayer, msg)
            if fail:
                assert held
                raise AssertionError("a bug in replaying")
            return held

        monkeypatch.setattr(replayer, "take", flaky)
        ops0 = rgpu.stats()["replayed_ops"]
        assert run("rgpu") == plain == cpu
        assert calls["n"] == 30 and not replayer.on  # off from the failure on
        assert rgpu.stats()["replayed_ops"] > ops0
        assert "replayed steps turned off" in caplog.text
