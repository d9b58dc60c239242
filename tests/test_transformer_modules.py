"""PyTorch's own transformer modules on rgpu, their fast paths included, against the CPU bit for
bit: in eval mode without grad, `nn.MultiheadAttention` runs one fused kernel that takes its
self-attention path only when query, key and value are one tensor, and `nn.TransformerEncoder`
packs a padded batch into a nested tensor (`rgpu.nested_ops`).

The server computes on one thread, as the client's torch does meanwhile (`one_thread`)."""

from __future__ import annotations

import warnings

import pytest
import torch

import rgpu
from rgpu.plans import INFO

LENGTHS = (5, 3, 4)


@pytest.fixture
def sess(one_thread):
    return rgpu.connect(one_thread.url)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():  # the nested-tensor API's prototype warning
        warnings.simplefilter("ignore", UserWarning)
        yield


def _batch(device: str, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.linspace(-1, 1, 3 * 6 * 8).reshape(3, 6, 8).mul(scale).to(device)
    padding = torch.tensor([[False] * n + [True] * (5 - n) for n in LENGTHS], device=device)
    return x[:, :5], padding  # a view: the client sends it as one, three times to attention


def _encoder(device: str, mask_check: bool = True, **kwargs) -> torch.nn.Module:
    torch.manual_seed(6)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, **kwargs)
    norm = torch.nn.LayerNorm(8)
    m = torch.nn.TransformerEncoder(layer, 2, norm=norm, mask_check=mask_check)
    return m.to(device).eval()


@pytest.mark.parametrize("padded", [True, False])
def test_self_attention_of_a_view_takes_the_cpus_path(sess, padded):
    """A view named three times in one op is one tensor on the server, as on the CPU; before,
    the server rebuilt it three times and the kernel took its cross-attention path (results
    off in the last bits)."""

    def attend(device):
        torch.manual_seed(6)
        m = torch.nn.MultiheadAttention(8, 2, batch_first=True).to(device).eval()
        x, padding = _batch(device)
        with torch.no_grad():
            return m(x, x, x, key_padding_mask=padding if padded else None)[0].cpu()

    assert torch.equal(attend("rgpu"), attend("cpu"))


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_encoder_fast_path_with_padding_equals_the_cpu(sess, activation, dtype):
    def encode(device):
        m = _encoder(device, activation=activation).to(dtype)
        outs = []
        with torch.inference_mode():
            for step in range(3):
                x, padding = _batch(device, scale=step + 1)
                outs.append(m(x.to(dtype), src_key_padding_mask=padding).cpu())
        return outs

    for a, b in zip(encode("cpu"), encode("rgpu")):
        assert torch.equal(a, b)
        assert not a[1, 3:].any()  # the padding comes back as zeros from the nested path


def test_encoder_decoder_transformer_in_eval_equals_the_cpu(sess):
    def run(device):
        torch.manual_seed(6)
        m = torch.nn.Transformer(8, 2, 2, 2, 16, dropout=0.0, batch_first=True).to(device).eval()
        x, padding = _batch(device)
        with torch.no_grad():
            return m(x, x[:, :4], src_key_padding_mask=padding,
                     memory_key_padding_mask=padding).cpu()  # fmt: skip

    assert torch.equal(run("rgpu"), run("cpu"))


def test_replayed_encoder_steps_equal_the_cpu(sess, replay_on):
    def encode(device):
        m = _encoder(device, mask_check=False)  # the check reads the mask: a wait mid-step
        x, padding = _batch(device)
        with torch.no_grad():
            for _ in range(8):
                x = m(x, src_key_padding_mask=padding).tanh() * 0.9 + 0.05
                if device == "rgpu":
                    torch.rgpu.synchronize()  # each step a segment of its own
        return x.cpu()

    ops0 = rgpu.stats()["replayed_ops"]
    remote = encode("rgpu")
    assert rgpu.stats()["replayed_ops"] - ops0 > 3 * 4
    assert torch.equal(remote, encode("cpu"))


def test_a_nested_tensor_is_refused_by_other_ops_and_the_session_goes_on(sess):
    x, padding = _batch("rgpu")
    nested = torch._nested_tensor_from_mask(x.contiguous(), padding.logical_not())
    for use in (lambda: nested + 1, lambda: nested.cpu(), lambda: nested.sum(),
                lambda: repr(nested), lambda: nested.view(-1)):  # fmt: skip
        with pytest.raises(RuntimeError, match="nested tensor, made by nn.TransformerEncoder"):
            use()
    # padded to the longest sequence (the server says how long) or to a size given
    cpu_nested = torch._nested_tensor_from_mask(x.cpu().contiguous(), padding.cpu().logical_not())
    assert torch.equal(nested.to_padded_tensor(0.0).cpu(), cpu_nested.to_padded_tensor(0.0))
    assert torch.equal(nested.to_padded_tensor(-1.0, (3, 6, 8)).cpu(),
                       cpu_nested.to_padded_tensor(-1.0, (3, 6, 8)))  # fmt: skip
    assert (x + 1).sum().item() == (x.cpu() + 1).sum().item()


def test_a_mask_with_gaps_fails_as_on_the_cpu(sess):
    x, _ = _batch("rgpu")
    gaps = torch.tensor([[True] * 5, [False] + [True] * 4, [True] * 5], device="rgpu")
    nested = torch._nested_tensor_from_mask(x.contiguous(), gaps, mask_check=True)
    with pytest.raises(rgpu.RemoteError, match="Mask must be left-aligned without gaps"):
        nested.to_padded_tensor(0.0, (3, 5, 8)).cpu()
    assert x.sum().item() == pytest.approx(x.cpu().sum().item())


def test_a_nested_result_the_client_did_not_expect_is_an_error_not_a_broken_session(sess):
    """The server's own check, should an op hand back a nested tensor unannounced: here
    `_nested_tensor_from_mask` with rgpu's handling of it turned off."""
    op = torch.ops.aten._nested_tensor_from_mask.default
    x, padding = _batch("rgpu")
    x, valid = x.contiguous(), padding.logical_not()
    torch._nested_tensor_from_mask(x, valid)  # its OpInfo exists from here
    info = INFO[id(op)]
    special, info.special = info.special, None
    try:
        with pytest.raises(rgpu.RemoteError, match="produced a nested tensor; rgpu supports"):
            torch._nested_tensor_from_mask(x, valid)
    finally:
        info.special = special
    assert x.sum().item() == pytest.approx(x.cpu().sum().item())
