"""Hugging Face models loaded and saved on the server: real `transformers` models saved with
`save_pretrained` into a real server's data directory, compared with the CPU model loaded from
the same folder."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch
from rgpu_test_servers import ServerProcess

import rgpu
import rgpu.files as rf

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
import rgpu.hf as rh  # noqa: E402

IDS = torch.tensor([[5, 17, 3, 42, 8, 1]])


def _gpt2():
    config = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000,
                                     n_positions=64, bos_token_id=0, eos_token_id=999)  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _llama():
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=256, vocab_size=1000, bos_token_id=0, eos_token_id=999,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    data = tmp_path_factory.mktemp("models")
    hub = tmp_path_factory.mktemp("hub")
    torch.manual_seed(0)
    _gpt2().save_pretrained(data / "gpt2")
    _llama().save_pretrained(data / "llama")
    _llama().save_pretrained(data / "llama-sharded", max_shard_size="400KB")
    _fake_hub(hub, "tiny-org/tiny-gpt2", data / "gpt2")
    srv = ServerProcess("--data-dir", str(data), env={"HF_HUB_CACHE": str(hub)})
    yield srv, data
    rgpu.disconnect()
    srv.stop()


def _fake_hub(cache, repo: str, folder) -> None:
    """The layout huggingface_hub downloads into: refs/main -> snapshots/SHA/* -> blobs/*."""
    org, name = repo.split("/")
    root = cache / f"models--{org}--{name}"
    commit = hashlib.sha1(repo.encode()).hexdigest()
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True)
    (root / "blobs").mkdir()
    for f in folder.iterdir():
        blob = root / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        blob.write_bytes(f.read_bytes())
        os.symlink(os.path.relpath(blob, snap), snap / f.name)


@pytest.fixture
def session(models):
    srv, data = models
    rgpu.connect(srv.url)
    return data


def _weight_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


@pytest.mark.parametrize("folder", ["gpt2", "llama", "llama-sharded", "hub:tiny-org/tiny-gpt2"])
def test_a_model_loads_on_the_server_with_the_cpu_models_logits_and_tokens(session, folder):
    local = session / ("gpt2" if folder.startswith("hub:") else folder)
    cpu = transformers.AutoModelForCausalLM.from_pretrained(local)
    before = rgpu.stats()
    model = rh.from_pretrained(transformers.AutoModelForCausalLM, folder)
    after = rgpu.stats()
    moved = after["bytes_in"] + after["bytes_out"] - before["bytes_in"] - before["bytes_out"]
    assert moved < 0.01 * _weight_bytes(cpu)  # config files and metadata; no weights
    assert type(model) is type(cpu)
    assert {p.device.type for p in model.parameters()} == {"rgpu"}
    assert model.generation_config.eos_token_id == 999
    with torch.no_grad():
        logits = model(IDS.to("rgpu")).logits.cpu()
        expected = cpu(IDS).logits
    if "gpt2" in folder:
        assert torch.equal(logits, expected)
    else:  # Llama's grouped-query attention takes rgpu's math path, the CPU a fused kernel
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-6)
    tokens = model.generate(IDS.to("rgpu"), max_new_tokens=8, do_sample=False).cpu()
    assert torch.equal(tokens, cpu.generate(IDS, max_new_tokens=8, do_sample=False))


def test_tied_weights_stay_tied(session):
    model = rh.from_pretrained(transformers.GPT2LMHeadModel, "gpt2")
    assert model.lm_head.weight is model.transformer.wte.weight


def test_a_dtype_is_applied_on_the_server(session):
    model = rh.from_pretrained(transformers.AutoModelForCausalLM, "gpt2", dtype=torch.bfloat16)
    cpu = transformers.AutoModelForCausalLM.from_pretrained(session / "gpt2", dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    for (name, p), q in zip(model.named_parameters(), cpu.parameters()):
        assert torch.equal(p.detach().cpu(), q.detach()), name


def test_a_fine_tuned_model_saved_on_the_server_loads_back_anywhere(session):
    model = rh.from_pretrained(transformers.AutoModelForCausalLM, "llama")
    cpu = transformers.AutoModelForCausalLM.from_pretrained(session / "llama")
    for m in (model, cpu):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        ids = IDS.to(next(m.parameters()).device)
        for _ in range(2):
            opt.zero_grad()
            m(ids, labels=ids).loss.backward()
            opt.step()
    before = rgpu.stats()["bytes_out"]
    rh.save_pretrained(model, "tuned")
    assert rgpu.stats()["bytes_out"] - before < 0.01 * _weight_bytes(cpu)
    assert sorted(rf.listdir("tuned")) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    reread = transformers.AutoModelForCausalLM.from_pretrained(
        session / "tuned"
    )  # plain transformers
    for (name, p), q in zip(reread.named_parameters(), cpu.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=name)
    again = rh.from_pretrained(transformers.AutoModelForCausalLM, "tuned")
    assert all(
        torch.equal(p.detach().cpu(), q.detach())
        for p, q in zip(again.parameters(), reread.parameters())
    )


def test_a_missing_folder_or_weights_are_clear_errors(session):
    (session / "empty").mkdir(exist_ok=True)
    with pytest.raises(rf.FileError, match="has no config.json"):
        rh.from_pretrained(transformers.AutoModelForCausalLM, "empty")
    (session / "empty" / "config.json").write_text((session / "gpt2" / "config.json").read_text())
    with pytest.raises(rf.FileError, match="no weights in 'empty'"):
        rh.from_pretrained(transformers.AutoModelForCausalLM, "empty")
    with pytest.raises(rf.FileError, match="not in this server's Hugging Face cache"):
        rh.from_pretrained(transformers.AutoModelForCausalLM, "hub:nobody/nothing")
    assert (torch.ones(2, device="rgpu") * 3).sum().item() == 6.0


def test_a_model_loads_onto_the_current_device_or_device_maps(models, start_server):
    _, data = models
    srv = start_server("--virtual-devices", "2", "--data-dir", str(data))
    rgpu.connect(srv.url)
    cpu = transformers.AutoModelForCausalLM.from_pretrained(data / "gpt2")
    auto = transformers.AutoModelForCausalLM
    mapped = rh.from_pretrained(auto, "gpt2", device_map={"": "rgpu:1"})
    torch.rgpu.set_device(1)
    try:
        current = rh.from_pretrained(auto, "gpt2")
    finally:
        torch.rgpu.set_device(0)
    for model in (mapped, current):
        assert {p.device for p in model.parameters()} == {torch.device("rgpu", 1)}
        with torch.no_grad():
            assert torch.equal(model(IDS.to("rgpu:1")).logits.cpu(), cpu(IDS).logits)
    with pytest.raises(ValueError, match="one rgpu device"):
        rh.from_pretrained(auto, "gpt2", device_map="auto")
