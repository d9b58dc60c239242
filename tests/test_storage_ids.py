"""Storage identity of rgpu tensors, as libraries that compare storage pointers read it.

safetensors and transformers' `save_pretrained` find shared and tied tensors by
`untyped_storage().data_ptr()`; on rgpu that raised "invalid python storage" (every wrapper's
storage held no memory), so saving an rgpu model to the laptop failed where a CUDA model saves.
"""

from __future__ import annotations

import io

import pytest
import torch
from safetensors.torch import load_file, save_file

import rgpu  # noqa: F401


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_a_tensor_and_its_views_share_one_storage_and_others_do_not(session):
    a = torch.arange(12.0, device="rgpu").reshape(3, 4)
    b = torch.zeros(3, 4, device="rgpu")
    views = [a[1], a.t(), a.detach(), a.view(-1)[5:], a.view(torch.int32)]
    assert all(_ptr(v) == _ptr(a) for v in views)
    assert all(v.untyped_storage() is a.untyped_storage() for v in views)
    assert a.untyped_storage().nbytes() == 48
    assert _ptr(a) != _ptr(b) and _ptr(a) != 0
    # byte ranges never overlap, as distinct allocations' do not
    lo, hi = sorted([a, b], key=_ptr)
    assert _ptr(lo) + lo.untyped_storage().nbytes() <= _ptr(hi)
    # a tensor's data_ptr is its storage's plus its offset in bytes, as on CUDA
    assert a.data_ptr() == _ptr(a)
    assert a[2, 1].data_ptr() == _ptr(a) + 9 * 4
    assert a.view(torch.int32)[1:].data_ptr() == _ptr(a) + 16
    assert a.clone().data_ptr() != a.data_ptr()


def test_storage_identity_follows_data_assignment_and_resize(session):
    p = torch.nn.Parameter(torch.ones(4, device="rgpu"))
    t = torch.zeros(6, device="rgpu")
    p.data = t
    assert _ptr(p) == _ptr(t)
    r = torch.ones(2, device="rgpu")
    before = r.untyped_storage().nbytes()
    r.resize_(100)
    assert r.untyped_storage().nbytes() == 400 != before


def test_reading_the_storage_downloads_it(session):
    x = torch.tensor([1.0, -2.0, 3.5])
    xr = x.to("rgpu")  # a storage does not keep its tensor's server memory alive: the tensor does
    s = xr.untyped_storage()
    assert s.tolist() == x.untyped_storage().tolist()
    assert s.cpu().tolist() == x.untyped_storage().tolist()


def test_safetensors_saves_an_rgpu_state_dict_as_the_cpu_one(session, tmp_path):
    torch.manual_seed(0)
    cpu = {"w": torch.randn(5, 3), "b": torch.randn(3).to(torch.bfloat16), "i": torch.arange(4)}
    save_file(cpu, tmp_path / "cpu.safetensors")
    save_file({k: v.to("rgpu") for k, v in cpu.items()}, tmp_path / "rgpu.safetensors")
    assert (tmp_path / "cpu.safetensors").read_bytes() == (
        tmp_path / "rgpu.safetensors"
    ).read_bytes()
    # two names for one storage are refused as on the CPU, not written twice
    w = cpu["w"].to("rgpu")
    with pytest.raises(RuntimeError, match="share memory"):
        save_file({"a": w, "b": w[1:]}, tmp_path / "shared.safetensors")
    loaded = load_file(tmp_path / "rgpu.safetensors")
    assert all(torch.equal(loaded[k], v) for k, v in cpu.items())


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_save_pretrained_of_an_rgpu_model_writes_what_the_cpu_model_writes(session, tmp_path, arch):
    transformers = pytest.importorskip("transformers")
    T = transformers
    torch.manual_seed(0)
    if arch == "gpt2":  # tied input and output embeddings: one tensor in the file
        cfg = T.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2, n_positions=64)
        model = T.GPT2LMHeadModel(cfg)
    else:
        cfg = T.LlamaConfig(
            vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        )  # fmt: skip
        model = T.LlamaForCausalLM(cfg)
    model.eval()
    model.save_pretrained(tmp_path / "cpu")
    model.to("rgpu").save_pretrained(tmp_path / "rgpu")
    cpu_file = load_file(tmp_path / "cpu" / "model.safetensors")
    rgpu_file = load_file(tmp_path / "rgpu" / "model.safetensors")
    assert sorted(rgpu_file) == sorted(cpu_file)
    assert all(torch.equal(rgpu_file[k], cpu_file[k]) for k in cpu_file)
    back = type(model).from_pretrained(tmp_path / "rgpu")
    ids = torch.tensor([[1, 2, 3, 4]])
    torch.testing.assert_close(back(ids).logits, model.to("cpu")(ids).logits, rtol=0, atol=0)


def test_set_onto_an_rgpu_storage_views_it_as_on_the_cpu(session):
    a = torch.arange(12.0)
    ar = a.to("rgpu")
    t = torch.empty(0, dtype=torch.int32, device="rgpu")
    t.set_(ar.untyped_storage(), 2, (2, 3), (3, 1))
    expected = torch.empty(0, dtype=torch.int32).set_(a.untyped_storage(), 2, (2, 3), (3, 1))
    assert torch.equal(t.cpu(), expected) and t.stride() == expected.stride()
    assert t.untyped_storage().data_ptr() == ar.untyped_storage().data_ptr()
    ar.add_(1)  # t views ar's storage: it sees the write
    a.add_(1)
    assert torch.equal(t.cpu(), expected)
    whole = torch.empty(0, device="rgpu").set_(ar[3:].untyped_storage())
    assert torch.equal(whole.cpu(), a)
    with pytest.raises(NotImplementedError, match="not the storage of a live rgpu tensor"):
        torch.empty(0, device="rgpu").set_(torch.ones(2).untyped_storage())


@pytest.mark.parametrize("where", ["rgpu", "rgpu:0", {"cpu": "rgpu"}, torch.device("rgpu")])
def test_torch_load_onto_rgpu_restores_values_layouts_and_sharing(session, where):
    """It was a segmentation fault (PyTorch copied into an rgpu storage's memory), then a refusal.
    Each storage is uploaded once; tensors that shared it on the CPU share it on rgpu."""
    torch.manual_seed(0)
    w = torch.randn(4, 6)
    saved = {
        "w": w, "row": w[1], "t": w.t(), "h": torch.randn(3).half(),
        "i": torch.arange(5), "b": torch.tensor([True, False]), "e": torch.empty(0),
    }  # fmt: skip
    buf = io.BytesIO()
    torch.save(saved, buf)
    buf.seek(0)
    loaded = torch.load(buf, map_location=where)
    for k, v in loaded.items():
        assert v.device.type == "rgpu", k
        assert torch.equal(v.cpu(), saved[k]) and v.stride() == saved[k].stride(), k
    assert loaded["w"].untyped_storage().data_ptr() == loaded["t"].untyped_storage().data_ptr()
    loaded["w"].add_(1)
    assert torch.equal(loaded["row"].cpu(), w[1] + 1)
    assert torch.equal(loaded["t"].cpu(), (w + 1).t())


def test_a_state_dict_loaded_onto_rgpu_gives_the_cpu_models_outputs(session):
    torch.manual_seed(0)
    lin = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    buf = io.BytesIO()
    torch.save(lin.state_dict(), buf)
    buf.seek(0)
    remote = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    remote.to("rgpu").load_state_dict(torch.load(buf, map_location="rgpu", weights_only=True))
    x = torch.randn(4, 3)
    assert torch.equal(remote(x.to("rgpu")).cpu(), lin(x))
