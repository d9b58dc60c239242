"""Many transformers architectures, one training step each, equal to local CPU torch bit for bit:
the loss and every gradient, with dropout on (seeded alike), and greedy tokens for the
generating ones. Small configs of transformers' own classes, chosen for what they exercise:
ALiBi (BLOOM), sliding windows (Gemma 2), partial rotary (Phi, GPT-NeoX), state-space scans
(Mamba, Jamba), multi-head latent attention and routed experts (DeepSeek-V3), relative position
buckets (T5), convolutional audio front ends (Whisper, wav2vec 2.0), FFTs (FNet), disentangled
attention (DeBERTa-v2), batch norm (MobileNetV2), windowed attention with transposed pooling
(Swin), overlapping patch merging (SegFormer), contrastive image-text loss (CLIP).

Found this way: Swin's gradients were silently wrong (layer norm's backward of a transposed
gradient was predicted transposed), and mixture-of-experts layers failed on a CPU server.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
T = transformers
V = 300
GEN = torch.Generator().manual_seed(1)
IDS = torch.randint(1, V, (2, 10), generator=GEN)
MASK = torch.ones(2, 10, dtype=torch.long)
MASK[1, 7:] = 0
PIXELS = torch.randn(2, 3, 32, 32, generator=GEN)
SMALL = dict(
    num_hidden_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    intermediate_size=64,
    vocab_size=V,
    max_position_embeddings=64,
)


def _lm(config, model, **kw):
    return lambda: getattr(T, model)(getattr(T, config)(**kw))


CAUSAL = {
    "qwen2": _lm("Qwen2Config", "Qwen2ForCausalLM", num_key_value_heads=2, **SMALL),
    "gemma2": _lm(
        "Gemma2Config",
        "Gemma2ForCausalLM",
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=4,
        **SMALL,
    ),
    "phi": _lm("PhiConfig", "PhiForCausalLM", **SMALL),
    "gpt_neox": _lm("GPTNeoXConfig", "GPTNeoXForCausalLM", **SMALL),
    "bloom": _lm(
        "BloomConfig", "BloomForCausalLM", n_layer=2, hidden_size=32, n_head=4, vocab_size=V
    ),
    "opt": _lm(
        "OPTConfig",
        "OPTForCausalLM",
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_dim=64,
        vocab_size=V,
        max_position_embeddings=64,
        word_embed_proj_dim=32,
    ),
    "mamba": _lm(
        "MambaConfig",
        "MambaForCausalLM",
        num_hidden_layers=2,
        hidden_size=32,
        vocab_size=V,
        state_size=4,
    ),
    "jamba": _lm(
        "JambaConfig",
        "JambaForCausalLM",
        num_key_value_heads=2,
        num_experts=2,
        num_experts_per_tok=1,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        mamba_d_state=4,
        use_mamba_kernels=False,
        **SMALL,
    ),
    "deepseek_v3": _lm(
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=8,
        v_head_dim=8,
        qk_nope_head_dim=8,
        n_group=1,
        topk_group=1,
        **SMALL,
    ),
    "t5": _lm(
        "T5Config",
        "T5ForConditionalGeneration",
        num_layers=2,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_heads=4,
        vocab_size=V,
        decoder_start_token_id=0,
    ),
}
ENCODERS = {
    "deberta_v2": _lm("DebertaV2Config", "DebertaV2ForSequenceClassification", **SMALL),
    "fnet": _lm(
        "FNetConfig",
        "FNetForSequenceClassification",
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        vocab_size=V,
        use_tpu_fourier_optimizations=False,
    ),
}
VISION = {
    "swin": _lm(
        "SwinConfig",
        "SwinForImageClassification",
        image_size=32,
        patch_size=4,
        embed_dim=8,
        depths=[1, 1],
        num_heads=[2, 2],
        window_size=4,
    ),
    "mobilenet_v2": _lm(
        "MobileNetV2Config",
        "MobileNetV2ForImageClassification",
        image_size=32,
        depth_multiplier=0.25,
    ),
    "segformer": _lm(
        "SegformerConfig",
        "SegformerForImageClassification",
        num_encoder_blocks=2,
        depths=[1, 1],
        sr_ratios=[2, 1],
        hidden_sizes=[8, 16],
        num_attention_heads=[1, 2],
        strides=[4, 2],
        patch_sizes=[7, 3],
    ),
}


def _whisper():
    cfg = T.WhisperConfig(
        vocab_size=100,
        num_mel_bins=8,
        encoder_layers=2,
        decoder_layers=2,
        d_model=32,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_source_positions=16,
        max_target_positions=32,
        decoder_start_token_id=1,
        pad_token_id=0,
        eos_token_id=2,
        bos_token_id=1,
        begin_suppress_tokens=None,
        suppress_tokens=None,
    )
    return T.WhisperForConditionalGeneration(cfg)


def _wav2vec2():
    cfg = T.Wav2Vec2Config(
        vocab_size=20,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        conv_dim=(16, 16),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=4,
        layerdrop=0.0,
        mask_time_prob=0.0,
        ctc_loss_reduction="mean",
        pad_token_id=0,
    )
    return T.Wav2Vec2ForCTC(cfg)  # no SpecAugment or LayerDrop: they draw from numpy and the CPU


def _clip():
    cfg = T.CLIPConfig(
        text_config=dict(
            vocab_size=100,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=16,
        ),
        vision_config=dict(
            image_size=16,
            patch_size=4,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
        ),
        projection_dim=16,
    )
    return T.CLIPModel(cfg)


FEATURES = torch.randn(2, 8, 32, generator=GEN)
OTHERS = {  # (model, batch, generate's inputs or None)
    "whisper": (
        _whisper,
        {"input_features": FEATURES, "labels": torch.randint(3, 100, (2, 5), generator=GEN)},
        {"input_features": FEATURES[:1]},
    ),
    "wav2vec2": (
        _wav2vec2,
        {
            "input_values": torch.randn(2, 800, generator=GEN),
            "labels": torch.randint(1, 20, (2, 6), generator=GEN),
        },
        None,
    ),
    "clip": (
        _clip,
        {
            "input_ids": torch.randint(0, 100, (3, 8), generator=GEN),
            "pixel_values": torch.randn(3, 3, 16, 16, generator=GEN),
            "return_loss": True,
        },
        None,
    ),
}


def _case(name: str):
    if name in CAUSAL:
        model = CAUSAL[name]()
        labels = IDS[:, :6].contiguous() if model.config.is_encoder_decoder else IDS
        return model, {"input_ids": IDS, "labels": labels}, {"input_ids": IDS[:1, :5]}
    if name in ENCODERS:
        return (
            ENCODERS[name](),
            {"input_ids": IDS, "attention_mask": MASK, "labels": torch.tensor([0, 1])},
            None,
        )
    if name in VISION:
        return VISION[name](), {"pixel_values": PIXELS, "labels": torch.tensor([0, 1])}, None
    make, batch, prompt = OTHERS[name]
    return make(), batch, prompt


def _moved(batch: dict, device: str) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


@pytest.mark.parametrize("name", [*CAUSAL, *ENCODERS, *VISION, *OTHERS])
def test_a_training_step_and_greedy_tokens_equal_the_cpu(session, name):
    torch.manual_seed(0)
    cpu, batch, prompt = _case(name)
    remote = copy.deepcopy(cpu).to("rgpu")
    losses = []
    for model, device in ((cpu, "cpu"), (remote, "rgpu")):
        model.train()
        torch.manual_seed(7)  # dropout draws alike: the CPU's generator, then the server's
        loss = model(**_moved(batch, device)).loss
        loss.backward()
        losses.append(loss.detach().cpu())
    assert torch.equal(losses[1], losses[0])
    for (where, p), q in zip(cpu.named_parameters(), remote.parameters()):
        assert (p.grad is None) == (q.grad is None), where
        if p.grad is not None:
            assert torch.equal(q.grad.cpu(), p.grad), where
    if prompt is not None:
        cpu.eval()
        remote.eval()
        kwargs = {"max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
        want = cpu.generate(**prompt, **kwargs)
        assert torch.equal(remote.generate(**_moved(prompt, "rgpu"), **kwargs).cpu(), want)
