"""`torch.inference_mode()` as users run it: with autograd's kernels skipped, composite ops
(`conv2d`, `scaled_dot_product_attention`, `batch_norm`, `__and__`) reach the device whole. Their
outputs must be laid out as on the CPU: read through a later view, a wrong layout was a wrong
number with no error (Llama's logits 0.3 off)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

GEN = torch.Generator().manual_seed(0)
X = torch.randn(2, 10, 4, 16, generator=GEN)
W = torch.randn(4, 4, 3, 3, generator=GEN)

CASES = {
    "sdpa": lambda x, w: F.scaled_dot_product_attention(*(x.transpose(1, 2),) * 3, is_causal=True),
    "conv2d": lambda x, w: F.conv2d(
        x.permute(0, 2, 1, 3).contiguous(memory_format=torch.channels_last), w, padding=1
    ),
    "batch_norm": lambda x, w: F.batch_norm(
        x.permute(0, 2, 1, 3), torch.zeros(4, device=x.device), torch.ones(4, device=x.device)
    ),
    "and": lambda x, w: (x > 0) & (x < 1),
    "linear_of_a_slice": lambda x, w: F.linear(x[:, -1:], w.reshape(-1)[:80].view(5, 16)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_composite_ops_lay_out_their_outputs_as_on_the_cpu(dev, case):
    f = CASES[case]
    with torch.inference_mode():
        want = f(X, W)
        got = f(X.to(dev), W.to(dev))
        assert got.stride() == want.stride() and got.dtype == want.dtype
        assert torch.equal(
            got.transpose(0, 1).contiguous().cpu(), want.transpose(0, 1).contiguous()
        )
        assert got.is_inference()


def test_views_of_normal_tensors_are_normal_tensors_as_on_the_cpu(dev):
    c = torch.arange(64.0)
    r = c.to(dev)
    with torch.inference_mode():
        vc, vr = c.view(8, 8), r.view(8, 8)
        assert vr.is_inference() == vc.is_inference() is False
        assert torch.equal((vr.t() * 2).cpu(), vc.t() * 2)
        up = torch.arange(4096.0).to(dev)  # made here: an inference tensor, no version counter
        again = torch.arange(4096.0).to(dev)
        assert up.is_inference() and torch.equal(again.cpu(), torch.arange(4096.0))


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_hugging_face_models_under_inference_mode_equal_the_cpu(session, arch):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if arch == "gpt2":
        cfg = transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=4, vocab_size=100, n_positions=32
        )
        cpu = transformers.GPT2LMHeadModel(cfg).eval()
    else:
        cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                       num_key_value_heads=2, intermediate_size=64, vocab_size=100)  # fmt: skip
        cpu = transformers.LlamaForCausalLM(cfg).eval()
    remote = copy.deepcopy(cpu).to("rgpu")
    ids = torch.randint(0, 100, (2, 9), generator=GEN)
    ids_r = ids.to("rgpu")  # a normal tensor, viewed inside
    kw = {"max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    with torch.inference_mode():
        assert torch.equal(remote(ids_r).logits.cpu(), cpu(ids).logits)
        assert torch.equal(remote.generate(ids_r, **kw).cpu(), cpu.generate(ids, **kw))
