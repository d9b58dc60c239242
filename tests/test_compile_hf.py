"""torch.compile on real Hugging Face models: GPT-2 (its KV cache starts from `torch.tensor([])`
inside the compiled code), Llama with grouped-query attention, BERT with a padding mask and a
ViT train compiled with the losses of local CPU torch, in a few messages a step."""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch

import rgpu

transformers = pytest.importorskip("transformers")

IDS = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(3))
MASK = torch.tensor([[1] * 16, [1] * 10 + [0] * 6])
PIXELS = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(4))


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=500, n_positions=64,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)), {"input_ids": IDS, "labels": IDS}  # fmt: skip


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=500)), {"input_ids": IDS, "labels": IDS}  # fmt: skip


def _bert():
    labels = IDS.masked_fill(MASK == 0, -100)
    return transformers.BertForMaskedLM(transformers.BertConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
        vocab_size=500, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)), {
        "input_ids": IDS, "attention_mask": MASK, "labels": labels}  # fmt: skip


def _vit():
    return transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=32, patch_size=8, num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
        intermediate_size=128, num_labels=5, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0)), {"pixel_values": PIXELS, "labels": torch.tensor([1, 4])}  # fmt: skip


def _fell_back(caught) -> list[str]:
    """rgpu's warnings that a graph ran as eager remote ops instead of shipping."""
    return [str(w.message) for w in caught if "eager remote ops" in str(w.message)]


def _train(model, batch, device, steps=3, compiled=None):
    run = model if compiled is None else compiled
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, messages = [], []
    for _ in range(steps):
        before = rgpu.stats()["messages"]
        opt.zero_grad()
        loss = run(**{k: v.to(device) for k, v in batch.items()}).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
        messages.append(rgpu.stats()["messages"] - before)
    return losses, messages


@pytest.mark.parametrize("make", [_gpt2, _llama, _bert, _vit], ids=["gpt2", "llama", "bert", "vit"])
def test_compiled_real_models_train_as_on_the_cpu_in_few_messages(session, make):
    torch.manual_seed(0)
    cpu, batch = make()
    remote, eager = copy.deepcopy(cpu).to("rgpu"), copy.deepcopy(cpu).to("rgpu")
    compiled = torch.compile(remote, backend=rgpu.compile_backend(compiler="eager"), dynamic=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, messages = _train(remote, batch, "rgpu", compiled=compiled)
    assert not _fell_back(caught)
    expected, _ = _train(cpu, batch, "cpu")
    if make is _llama:
        # compiled graphs are traced on meta tensors, where SiLU's gradient becomes its formula
        # (sigmoid and products) instead of the CPU's silu_backward kernel: last-bit differences
        torch.testing.assert_close(losses, expected, rtol=1e-6, atol=0)
    else:
        assert losses == expected
    rgpu.settings.replay = False  # eager op by op, as graph shipping replaces it
    try:
        _, eager_messages = _train(eager, batch, "rgpu")
    finally:
        rgpu.settings.replay = None
    assert messages[-1] * 5 < eager_messages[-1], (messages, eager_messages)


def test_gpt2_with_its_kv_cache_compiles_with_inductor(session):
    """The KV cache in training mode: its `torch.tensor([])` is made inside the traced code, and
    its `cat` with that empty constant runs in the server's Inductor graph."""
    torch.manual_seed(0)
    cpu, batch = _gpt2()
    remote = copy.deepcopy(cpu).to("rgpu")
    compiled = torch.compile(remote, backend=rgpu.compile_backend(), dynamic=False)
    # use_cache=True: the cache in training mode, as the report had it
    losses, _ = _train(remote, batch, "rgpu", compiled=lambda **kw: compiled(**kw, use_cache=True))
    expected, _ = _train(cpu, batch, "cpu", compiled=lambda **kw: cpu(**kw, use_cache=True))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-6, atol=1e-6)


def test_a_constant_made_inside_the_compiled_code_travels_in_the_graph(session):
    def f(x):
        scale = torch.tensor([1.0, 2.0, 3.0], device=x.device)
        empty = torch.tensor([], dtype=x.dtype, device=x.device)
        return torch.cat([empty, x * scale], dim=0)

    cf = torch.compile(f, backend=rgpu.compile_backend(compiler="eager"), dynamic=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = cf(torch.ones(3, device="rgpu"))
    assert not _fell_back(caught)
    assert torch.equal(out.cpu(), torch.tensor([1.0, 2.0, 3.0]))


def test_a_graph_inductor_cannot_compile_runs_op_by_op_with_the_same_results(session):
    """GPT-2 training with dropout and its cache: one graph Inductor cannot lower on the
    server (a view of what its `cat` lowering lays out otherwise). The server runs that graph
    op by op instead; the others stay compiled, so the losses equal the "eager" compiler's
    within Inductor's rounding."""
    before = rgpu.session_info()["compile"]["graphs_run_op_by_op"]
    results = {}
    for compiler in ("eager", "inductor"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        cpu = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=4, vocab_size=500, n_positions=64))  # fmt: skip
        remote = cpu.to("rgpu")
        compiled = torch.compile(remote, backend=rgpu.compile_backend(compiler), dynamic=False)
        torch.manual_seed(1)  # the dropout masks: the same stream for both
        results[compiler], _ = _train(remote, {"input_ids": IDS, "labels": IDS}, "rgpu",
                                      compiled=functools.partial(compiled, use_cache=True))  # fmt: skip
    torch.testing.assert_close(torch.tensor(results["inductor"]), torch.tensor(results["eager"]),
                               rtol=1e-6, atol=1e-6)  # fmt: skip
    assert rgpu.session_info()["compile"]["graphs_run_op_by_op"] > before


def test_compiled_mixture_of_experts_falls_back_where_it_must_and_trains_as_on_the_cpu(session):
    """DeepSeek-V3's routed experts call transformers' `grouped_mm_fallback`, a custom op whose
    body reads the expert offsets on the host. Dynamo raised (the body recursed in `tolist()`);
    now the graphs with that op run as eager remote ops, with one warning each, and the rest
    ship."""
    torch.manual_seed(0)
    cpu = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=64, vocab_size=500, max_position_embeddings=64, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
        kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8,
        n_group=1, topk_group=1))  # fmt: skip
    remote = copy.deepcopy(cpu).to("rgpu")
    compiled = torch.compile(remote, backend=rgpu.compile_backend(compiler="eager"), dynamic=False)
    batch = {"input_ids": IDS, "labels": IDS}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, _ = _train(remote, batch, "rgpu", steps=2, compiled=compiled)
    assert any("transformers::grouped_mm_fallback" in m for m in _fell_back(caught))
    expected, _ = _train(cpu, batch, "cpu", steps=2)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "make, options",
    [(_gpt2, dict(backend="rgpu")), (_llama, dict(mode="reduce-overhead"))],
    ids=["gpt2", "llama-default-backend"],
)
def test_compiled_decoding_with_a_static_cache_gives_the_cpus_tokens(session, make, options):
    """transformers' fast generation: a static KV cache and a compiled forward. The cache's
    tensors are made inside the compiled prefill (`torch.zeros(..., device=key.device)`), and
    came back as bare meta tensors: the next step failed ("cannot copy a meta tensor"). Llama
    compiles as transformers' CompileConfig does, with the default backend."""
    torch.manual_seed(0)
    cpu, _ = make()
    cpu.eval()
    remote = copy.deepcopy(cpu).to("rgpu")
    remote.forward = torch.compile(remote.forward, dynamic=False, **options)
    prompt = IDS[:1, :6]
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, cache_implementation="static")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = remote.generate(prompt.to("rgpu"), **kw)
        got_again = remote.generate(prompt.to("rgpu"), **kw)  # the compiled decode step again
    assert not _fell_back(caught)
    want = cpu.generate(prompt, **kw)
    assert torch.equal(got.cpu(), want) and torch.equal(got_again.cpu(), want)
