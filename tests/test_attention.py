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


@pytest.mark.parametrize(
    "case",
    ["mask", "bool_mask", "gqa", "three_d", "broadcast_heads", "no_grad"],
)
def test_other_calls_take_the_math_path_and_match(session, case):
    cpu, remote = _qkv(2, 4, 24, 8, seed=1)
    kwargs: dict = {}
    if case == "mask":
        m = torch.randn(24, 24)
        kwargs_cpu, kwargs_r = {"attn_mask": m}, {"attn_mask": m.to("rgpu")}
    elif case == "bool_mask":
        m = torch.rand(24, 24) > 0.3
        m.fill_diagonal_(True)
        kwargs_cpu, kwargs_r = {"attn_mask": m}, {"attn_mask": m.to("rgpu")}
    elif case == "gqa":
        cpu[1], cpu[2] = (t.detach()[:, :2].requires_grad_() for t in cpu[1:])
        remote[1], remote[2] = (t.detach().to("rgpu").requires_grad_() for t in cpu[1:])
        kwargs_cpu = kwargs_r = {"enable_gqa": True}
    elif case == "three_d":
        cpu = [t.detach()[0].requires_grad_() for t in cpu]
        remote = [t.detach().to("rgpu").requires_grad_() for t in cpu]
        kwargs_cpu = kwargs_r = {"is_causal": True}
    elif case == "broadcast_heads":
        cpu[0] = cpu[0].detach()[:, :1].requires_grad_()
        remote[0] = cpu[0].detach().to("rgpu").requires_grad_()
        kwargs_cpu = kwargs_r = {}
    else:
        kwargs_cpu = kwargs_r = {"is_causal": True}
    kwargs = kwargs_cpu
    if case == "no_grad":
        with torch.no_grad():
            out = F.scaled_dot_product_attention(*cpu, **kwargs)
            out_r = F.scaled_dot_product_attention(*remote, **kwargs_r)
        torch.testing.assert_close(out_r.cpu(), out, rtol=1e-5, atol=1e-6)
        return
    out = F.scaled_dot_product_attention(*cpu, **kwargs)
    out_r = F.scaled_dot_product_attention(*remote, **kwargs_r)
    torch.testing.assert_close(out_r.cpu(), out, rtol=1e-5, atol=1e-6)
    out.sum().backward()
    out_r.sum().backward()
    for a, b in zip(cpu, remote):
        torch.testing.assert_close(b.grad.cpu(), a.grad, rtol=1e-5, atol=1e-6)


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
