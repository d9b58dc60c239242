"""`F.scaled_dot_product_attention` on rgpu: one fused op each way where the CPU would fuse too,
the math path elsewhere; values and gradients against the same calls on the CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import rgpu


def _qkv(*shape: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    cpu = [torch.randn(*shape, generator=g, dtype=dtype, requires_grad=True) for _ in range(3)]
    remote = [t.detach().to("rgpu").requires_grad_() for t in cpu]
    return cpu, remote


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_fused_attention_is_the_cpus_kernel_bit_for_bit(session, causal, dtype):
    cpu, remote = _qkv(4, 3, 48, 16, dtype=dtype)
    grad = torch.randn(4, 3, 48, 16, dtype=dtype)
    grad_r = grad.to("rgpu")
    torch.rgpu.synchronize()
    m0 = rgpu.stats()["messages"]
    out = F.scaled_dot_product_attention(*cpu, is_causal=causal, scale=0.3)
    out_r = F.scaled_dot_product_attention(*remote, is_causal=causal, scale=0.3)
    assert rgpu.stats()["messages"] - m0 == 1  # one op, not the math path's ~15
    out.backward(grad)
    out_r.backward(grad_r)
    # one op for all three gradients; then autograd copies each into its input's layout (the
    # kernel returns them head-major), new_empty_strided + copy_ each, as it does on the CPU
    assert rgpu.stats()["messages"] - m0 == 1 + 1 + 3 * 2
    assert torch.equal(out_r.cpu(), out)
    for a, b in zip(cpu, remote):
        assert torch.equal(b.grad.cpu(), a.grad)


def test_strided_inputs_as_a_transformer_makes_them(session):
    # q, k, v split from one projection and transposed to (batch, heads, time, head_dim)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 20, 3 * 32, generator=g, requires_grad=True)
    xr = x.detach().to("rgpu").requires_grad_()

    def attend(t):
        q, k, v = t.split(32, dim=2)
        q, k, v = (z.view(2, 20, 4, 8).transpose(1, 2) for z in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).sum()

    attend(x).backward()
    attend(xr).backward()
    assert torch.equal(xr.grad.cpu(), x.grad)


def _case(case: str):
    """(cpu q/k/v, remote q/k/v, cpu kwargs, remote kwargs) for one kind of call."""
    cpu, remote = _qkv(2, 4, 24, 8, seed=1)
    g = torch.Generator().manual_seed(2)
    kw: dict = {}
    if case in ("mask", "causal_mask"):
        kw = {"attn_mask": torch.randn(24, 24, generator=g), "is_causal": case == "causal_mask"}
    elif case == "bool_mask":
        m = torch.rand(24, 24, generator=g) > 0.3
        kw = {"attn_mask": m.fill_diagonal_(True)}
    elif case == "padding_mask":  # (batch, 1, 1, keys), broadcast over heads and queries
        m = torch.zeros(2, 1, 1, 24)
        m[1, ..., 17:] = float("-inf")
        kw = {"attn_mask": m}
    elif case in ("gqa", "gqa_decode"):
        cpu[1], cpu[2] = (t.detach()[:, :2].requires_grad_() for t in cpu[1:])
        if case == "gqa_decode":  # one new query over a cache, as generate() calls it
            cpu[0] = cpu[0].detach()[:, :, -1:].requires_grad_()
        kw = {"enable_gqa": True}
    elif case == "three_d":
        cpu = [t.detach()[0].requires_grad_() for t in cpu]
        kw = {"is_causal": True}
    elif case == "broadcast_heads":
        cpu[0] = cpu[0].detach()[:, :1].requires_grad_()
    elif case == "mask_with_grad":
        kw = {"attn_mask": torch.randn(24, 24, generator=g, requires_grad=True)}
    remote = [t.detach().to("rgpu").requires_grad_() for t in cpu]
    kw_r = {k: v.detach().to("rgpu").requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor)
            else v for k, v in kw.items()}  # fmt: skip
    return cpu, remote, kw, kw_r


@pytest.mark.parametrize(
    "case", ["mask", "causal_mask", "bool_mask", "padding_mask", "gqa", "gqa_decode"]
)
@pytest.mark.parametrize("grad", [True, False])
def test_calls_the_cpu_fuses_are_fused_bit_for_bit(session, case, grad):
    # local CPU torch runs these as its flash kernel too (masks and grouped-query heads included):
    # the same kernel on the server gives the CPU's numbers exactly, in one op, not ~15
    cpu, remote, kw, kw_r = _case(case)
    torch.rgpu.synchronize()
    m0 = rgpu.stats()["messages"]
    with torch.set_grad_enabled(grad):
        out = F.scaled_dot_product_attention(*cpu, **kw)
        out_r = F.scaled_dot_product_attention(*remote, **kw_r)
    assert rgpu.stats()["messages"] - m0 == (
        4 if case == "bool_mask" else 1
    )  # + the mask made 0/-inf
    assert torch.equal(out_r.cpu(), out)
    if grad:
        out.sum().backward()
        out_r.sum().backward()
        for a, b in zip(cpu, remote):
            assert torch.equal(b.grad.cpu(), a.grad)


@pytest.mark.parametrize("case", ["three_d", "broadcast_heads", "mask_with_grad"])
def test_other_calls_take_the_math_path_and_match(session, case):
    cpu, remote, kw, kw_r = _case(case)
    torch.rgpu.synchronize()
    m0 = rgpu.stats()["messages"]
    out = F.scaled_dot_product_attention(*cpu, **kw)
    out_r = F.scaled_dot_product_attention(*remote, **kw_r)
    assert rgpu.stats()["messages"] - m0 > 5  # the math path's ops: the CPU does not fuse these
    torch.testing.assert_close(out_r.cpu(), out, rtol=1e-5, atol=1e-6)
    out.sum().backward()
    out_r.sum().backward()
    for a, b in zip(cpu + list(kw.values())[:1], remote + list(kw_r.values())[:1]):
        if isinstance(a, torch.Tensor) and a.requires_grad:
            torch.testing.assert_close(b.grad.cpu(), a.grad, rtol=1e-5, atol=1e-6)


def test_a_mask_of_another_float_dtype_fails_as_on_the_cpu(session):
    cpu, remote, _, _ = _case("none")
    m = torch.randn(24, 24, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="attn_mask dtype") as local:
        F.scaled_dot_product_attention(*cpu, attn_mask=m)
    with pytest.raises(RuntimeError, match="attn_mask dtype") as remote_err:
        F.scaled_dot_product_attention(*remote, attn_mask=m.to("rgpu"))
    assert str(remote_err.value).split(":")[0] == str(local.value).split(":")[0]


def test_dropout_takes_the_math_path_with_the_sessions_generator(session):
    cpu, remote = _qkv(2, 2, 16, 8, seed=2)
    torch.manual_seed(7)  # seeds the CPU generator and this session's generator alike
    out = F.scaled_dot_product_attention(*cpu, dropout_p=0.3)
    out_r = F.scaled_dot_product_attention(*remote, dropout_p=0.3)
    torch.testing.assert_close(out_r.cpu(), out, rtol=1e-5, atol=1e-6)


def test_under_autocast(session):
    cpu, remote = _qkv(2, 2, 16, 8, seed=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = F.scaled_dot_product_attention(*cpu, is_causal=True)
    with torch.autocast("rgpu", dtype=torch.bfloat16):
        out_r = F.scaled_dot_product_attention(*remote, is_causal=True)
    assert out_r.dtype == out.dtype
    torch.testing.assert_close(out_r.cpu(), out, rtol=1e-2, atol=1e-2)


def test_sdpa_kernel_math_is_respected(session):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cpu, remote = _qkv(2, 2, 16, 8, seed=5)
    torch.rgpu.synchronize()
    m0 = rgpu.stats()["messages"]
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(*cpu, is_causal=True)
        out_r = F.scaled_dot_product_attention(*remote, is_causal=True)
    assert rgpu.stats()["messages"] - m0 > 5  # the math path's ops, not the fused one
    torch.testing.assert_close(out_r.cpu(), out, rtol=1e-5, atol=1e-6)


def test_the_chooser_is_asked_once_per_layout_and_its_switches_still_count(session, monkeypatch):
    """The CPU's choice is kept by layout (asking builds q/k/v-sized stand-ins): a repeated
    call does not ask again, and what else the chooser reads (sdpa_kernel switches,
    requires_grad, grad mode) still changes the path, as on the CPU."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from rgpu import attention

    asked = []
    real = torch._fused_sdp_choice
    monkeypatch.setattr(
        torch, "_fused_sdp_choice", lambda *a, **k: asked.append(1) or real(*a, **k)
    )
    attention._CHOICES.clear()
    cpu, remote = _qkv(2, 2, 16, 8, seed=6)
    plain = [t.detach() for t in remote]

    def messages(fn) -> int:
        torch.rgpu.synchronize()
        m0 = rgpu.stats()["messages"]
        fn()
        return rgpu.stats()["messages"] - m0

    for _ in range(3):  # fused, asked once
        assert messages(lambda: F.scaled_dot_product_attention(*remote, is_causal=True)) == 1
    assert len(asked) == 1
    with sdpa_kernel(SDPBackend.MATH):  # the switch is part of the question
        assert messages(lambda: F.scaled_dot_product_attention(*remote, is_causal=True)) > 5
        out_r = F.scaled_dot_product_attention(*remote, is_causal=True)
        out = F.scaled_dot_product_attention(*cpu, is_causal=True)
    torch.testing.assert_close(out_r.cpu(), out, rtol=1e-5, atol=1e-6)
    assert len(asked) == 2
    with torch.no_grad():  # other inputs to the chooser: asked again, then kept
        F.scaled_dot_product_attention(*remote, is_causal=True)
        F.scaled_dot_product_attention(*remote, is_causal=True)
    F.scaled_dot_product_attention(*plain, is_causal=True)
    assert len(asked) == 4
    out_r = F.scaled_dot_product_attention(*remote, is_causal=True)
    out = F.scaled_dot_product_attention(*cpu, is_causal=True)
    assert torch.equal(out_r.cpu(), out) and len(asked) == 4
