"""Hugging Face models train on rgpu exactly as on local CPU torch: every gradient of a step,
bit for bit, and the losses of three AdamW steps. Small configs of transformers' own classes:
a causal LM (GPT-2), one with grouped-query attention and SiLU (Llama), an encoder with a
padding mask (BERT), vision models (ViT; Swin, whose pooling hands layer norm's backward a
transposed gradient) and a mixture of experts (Mixtral: top-k routing, `histc` on integer expert
ids and `grouped_mm`, the paths transformers takes on an accelerator)."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

GEN = torch.Generator().manual_seed(5)
IDS = torch.randint(0, 300, (3, 14), generator=GEN)
MASK = torch.ones(3, 14, dtype=torch.long)
MASK[1, 9:] = 0
PIXELS = torch.randn(3, 3, 16, 16, generator=GEN)


def _gpt2():
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=300, n_positions=32,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg), {"input_ids": IDS, "labels": IDS}


def _llama():
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, vocab_size=300)  # fmt: skip
    return transformers.LlamaForCausalLM(cfg), {"input_ids": IDS, "labels": IDS}


def _bert():
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                  intermediate_size=64, vocab_size=300, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)  # fmt: skip
    labels = IDS.masked_fill(MASK == 0, -100)
    return transformers.BertForMaskedLM(cfg), {"input_ids": IDS, "attention_mask": MASK,
                                               "labels": labels}  # fmt: skip


def _vit():
    cfg = transformers.ViTConfig(image_size=16, patch_size=4, num_hidden_layers=2, hidden_size=32,
                                 num_attention_heads=4, intermediate_size=64, num_labels=5,
                                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # fmt: skip
    return transformers.ViTForImageClassification(cfg), {
        "pixel_values": PIXELS, "labels": torch.tensor([1, 4, 0])}  # fmt: skip


def _swin():
    cfg = transformers.SwinConfig(image_size=16, patch_size=2, embed_dim=8, depths=[1, 1],
                                  num_heads=[2, 2], window_size=4, num_labels=5,
                                  drop_path_rate=0.0)  # fmt: skip
    return transformers.SwinForImageClassification(cfg), {
        "pixel_values": PIXELS, "labels": torch.tensor([1, 4, 0])}  # fmt: skip


def _mixtral():
    return transformers.MixtralForCausalLM(MIXTRAL), {"input_ids": IDS, "labels": IDS}


MIXTRAL = transformers.MixtralConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                     num_key_value_heads=2, intermediate_size=64, vocab_size=300,
                                     num_local_experts=4, num_experts_per_tok=2)  # fmt: skip
MODELS = [_gpt2, _llama, _bert, _vit, _swin, _mixtral]


@pytest.mark.parametrize("make", MODELS, ids=[m.__name__[1:] for m in MODELS])
def test_gradients_and_adamw_steps_equal_the_cpu(session, make):
    torch.manual_seed(0)
    cpu, batch = make()
    remote = copy.deepcopy(cpu).to("rgpu")
    opt_c = torch.optim.AdamW(cpu.parameters(), lr=1e-2)
    opt_r = torch.optim.AdamW(remote.parameters(), lr=1e-2)
    batch_r = {k: v.to("rgpu") for k, v in batch.items()}
    for step in range(3):
        loss_c = cpu(**batch).loss
        loss_r = remote(**batch_r).loss
        loss_c.backward()
        loss_r.backward()
        assert loss_r.item() == loss_c.item(), step
        if step == 0:
            for (name, p), q in zip(cpu.named_parameters(), remote.parameters()):
                assert torch.equal(q.grad.cpu(), p.grad), name
        opt_c.step()
        opt_r.step()
        opt_c.zero_grad()
        opt_r.zero_grad()
    for (name, p), q in zip(cpu.named_parameters(), remote.parameters()):
        assert torch.equal(q.detach().cpu(), p.detach()), name


def test_a_mixture_of_experts_generates_the_cpus_tokens(session):
    torch.manual_seed(0)
    cpu = transformers.MixtralForCausalLM(MIXTRAL).eval()
    remote = copy.deepcopy(cpu).to("rgpu")
    prompt = IDS[:1, :6]
    kw = {"max_new_tokens": 10, "min_new_tokens": 10, "pad_token_id": 0}
    want = cpu.generate(prompt, do_sample=False, **kw)
    assert torch.equal(remote.generate(prompt.to("rgpu"), do_sample=False, **kw).cpu(), want)
    torch.manual_seed(3)
    want = cpu.generate(prompt, do_sample=True, top_k=20, **kw)
    torch.manual_seed(3)
    got = remote.generate(prompt.to("rgpu"), do_sample=True, top_k=20, **kw).cpu()
    assert torch.equal(got, want)


@pytest.mark.parametrize("make", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_resized_token_embeddings_train_as_on_the_cpu(session, make):
    # resize_token_embeddings assigns `.data`: on rgpu the weights kept the old vocabulary
    # (logits of 300 columns where the CPU gave 320) until the loss failed on a shape
    torch.manual_seed(0)
    cpu, batch = make()
    remote = copy.deepcopy(cpu).to("rgpu")
    for model in (cpu, remote):
        torch.manual_seed(1)
        model.resize_token_embeddings(320, mean_resizing=False)
    ids = IDS.clone()
    ids[:, -3:] = torch.tensor([301, 310, 319])  # tokens only the new rows know
    batch = {"input_ids": ids, "labels": ids}
    loss_c = cpu(**batch).loss
    loss_r = remote(**{k: v.to("rgpu") for k, v in batch.items()}).loss
    assert loss_r.item() == loss_c.item()
    loss_c.backward()
    loss_r.backward()
    for (name, p), q in zip(cpu.named_parameters(), remote.parameters()):
        assert torch.equal(q.grad.cpu(), p.grad), name
    assert remote.get_output_embeddings().weight.shape == (320, 32)


def _trainer_run(model: torch.nn.Module, tmp_path, use_cpu: bool) -> tuple[list, torch.nn.Module]:
    """Four logged steps of transformers' Trainer, in a fresh accelerate state (it is one per
    process: the device of the first Trainer would stay)."""
    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state(True)
    PartialState._reset_state()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / ("cpu" if use_cpu else "rgpu")), report_to=[], max_steps=4,
        per_device_train_batch_size=4, logging_steps=1, save_strategy="no", use_cpu=use_cpu,
        disable_tqdm=True, seed=3,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(0, 300, (8,), generator=generator),
             "labels": torch.randint(0, 300, (8,), generator=generator)} for _ in range(16)]  # fmt: skip
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    AcceleratorState._reset_state(True)
    PartialState._reset_state()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], trainer.model


def test_transformers_trainer_trains_on_rgpu_as_on_the_cpu(session, tmp_path):
    """accelerate finds rgpu through `torch.accelerator`, while `TrainingArguments` knows
    accelerators by name and chose the CPU: Trainer put the model on rgpu and each batch on the
    CPU ("Expected all tensors to be on the same device")."""
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=300,
                                     n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    remote_losses, remote = _trainer_run(copy.deepcopy(model), tmp_path, use_cpu=False)
    cpu_losses, cpu = _trainer_run(model, tmp_path, use_cpu=True)
    assert next(remote.parameters()).device.type == "rgpu"
    assert remote_losses == cpu_losses and len(cpu_losses) == 4
    for p, q in zip(cpu.parameters(), remote.parameters()):
        assert torch.equal(q.detach().cpu(), p.detach())


def test_trainer_takes_bf16_and_autocasts_on_rgpu(session, tmp_path):
    """`TrainingArguments(bf16=True)` asked whether a GPU it knows by name runs bfloat16 and
    refused rgpu ("Your setup doesn't support bf16/gpu"); it now trains under
    `torch.autocast("rgpu", torch.bfloat16)`, as on a GPU: the first logged loss is the one an
    autocast forward on rgpu gives for the same batch."""
    from accelerate.state import AcceleratorState, PartialState

    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=300,
                                     n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 300, (16, 8), generator=generator)
    data = [{"input_ids": row, "labels": row} for row in ids]
    with torch.autocast("rgpu", dtype=torch.bfloat16):
        want = copy.deepcopy(model).to("rgpu")(input_ids=ids.to("rgpu"), labels=ids.to("rgpu"))
    want = want.loss.item()

    AcceleratorState._reset_state(True)
    PartialState._reset_state()
    try:
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path), report_to=[], max_steps=3, per_device_train_batch_size=16,
            logging_steps=1, save_strategy="no", disable_tqdm=True, bf16=True,
        )  # fmt: skip
        dtypes = set()
        model.transformer.h[0].mlp.c_fc.register_forward_hook(lambda m, i, o: dtypes.add(o.dtype))
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
        trainer.model_accepts_loss_kwargs = False  # the model's mean loss, not a token count's
        trainer.train()
    finally:
        AcceleratorState._reset_state(True)
        PartialState._reset_state()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert next(trainer.model.parameters()).device.type == "rgpu"
    assert dtypes == {torch.bfloat16} and len(losses) == 3
    assert abs(losses[0] - want) <= 1e-3 * abs(want)  # the batch's rows in the sampler's order
    assert torch.rgpu.is_bf16_supported() and torch.rgpu.is_bf16_supported(
        including_emulation=False
    )
