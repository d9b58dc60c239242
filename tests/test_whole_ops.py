"""Ops with a CPU kernel that PyTorch would break into smaller ops on rgpu (its formula for
devices without the kernel) go whole: the CPU's numbers bit for bit, in one message."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import rgpu
from rgpu import whole_ops


def test_the_list_is_every_such_op_of_this_pytorch():
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    found = set()
    for schema in torch._C._jit_get_all_schemas():
        if not schema.name.startswith("aten::"):
            continue
        name = schema.name + (f".{schema.overload_name}" if schema.overload_name else "")
        try:
            both = has(name, "CompositeImplicitAutograd") and has(name, "CPU")
        except RuntimeError:  # a schema with no operator behind it (aten::has_torch_function)
            continue
        if both:
            found.add(schema.name.removeprefix("aten::"))
    assert "silu_backward" in found  # the search itself works
    assert found <= set(whole_ops.WHOLE), f"add {sorted(found - set(whole_ops.WHOLE))}"


def _grad(fn, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    x = x.detach().requires_grad_()
    (gx,) = torch.autograd.grad(fn(x), x, g)
    return gx


@pytest.mark.parametrize("fn", [F.silu, F.mish], ids=["silu", "mish"])
def test_activation_gradients_are_the_cpus_kernel(session, fn):
    gen = torch.Generator().manual_seed(0)
    x, g = torch.randn(3, 33, 17, generator=gen), torch.randn(3, 33, 17, generator=gen)
    want = _grad(fn, x, g)
    xr, gr = x.to("rgpu").requires_grad_(), g.to("rgpu")
    y = fn(xr)
    torch.rgpu.synchronize()
    m0 = rgpu.stats()["messages"]
    (got,) = torch.autograd.grad(y, xr, gr)
    assert rgpu.stats()["messages"] - m0 == 1  # one kernel, not the formula's five or six ops
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("fn", [F.silu, F.mish], ids=["silu", "mish"])
def test_double_backward_takes_the_formula_as_on_the_cpu(session, fn):
    gen = torch.Generator().manual_seed(1)
    x, g = torch.randn(5, 8, generator=gen), torch.randn(5, 8, generator=gen)
    xs = x.clone().requires_grad_()
    (gx,) = torch.autograd.grad(fn(xs), xs, g, create_graph=True)
    (want,) = torch.autograd.grad(gx.sum(), xs)
    xr = x.to("rgpu").requires_grad_()
    (gxr,) = torch.autograd.grad(fn(xr), xr, g.to("rgpu"), create_graph=True)
    (got,) = torch.autograd.grad(gxr.sum(), xr)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(gxr.detach().cpu(), gx.detach(), rtol=1e-6, atol=1e-7)


def test_native_channel_shuffle(session):
    x = torch.arange(2 * 6 * 3 * 2, dtype=torch.float32).reshape(2, 6, 3, 2)
    xr = x.to("rgpu")
    torch.rgpu.synchronize()
    m0 = rgpu.stats()["messages"]
    with torch.no_grad():
        got = torch.native_channel_shuffle(xr, 3)
    assert rgpu.stats()["messages"] - m0 == 1
    assert torch.equal(got.cpu(), torch.native_channel_shuffle(x, 3))


def _composites():
    gen = torch.Generator().manual_seed(3)
    x3, w, b = (torch.randn(2, 5, 16, generator=gen), torch.randn(8, 16, generator=gen),
                torch.randn(8, generator=gen))  # fmt: skip
    m = torch.randn(16, 7, generator=gen)
    return {
        "linear": (F.linear, (x3, w, b)),
        "linear_no_bias_transposed": (F.linear, (x3.transpose(0, 1), w)),
        "matmul_batched": (torch.matmul, (x3, m)),
        "matmul_vector": (torch.matmul, (x3[0, 0], m)),
        "matmul_broadcast": (torch.matmul, (m.t()[None], x3.transpose(1, 2))),
        "softmax": (lambda t: torch.softmax(t, -1), (x3,)),
        "log_softmax_dtype": (lambda t: torch.log_softmax(t, 1, dtype=torch.float64), (x3,)),
    }


@pytest.mark.parametrize("case", list(_composites()))
def test_composites_without_a_gradient_go_whole_and_equal_the_cpu(session, case):
    fn, args = _composites()[case]
    remote = [a.to("rgpu") for a in args]
    torch.rgpu.synchronize()
    m0 = rgpu.stats()["messages"]
    with torch.no_grad():
        got = fn(*remote)
    assert rgpu.stats()["messages"] - m0 == 1  # the whole op; its parts run on the server
    want = fn(*args)
    assert got.shape == want.shape and got.stride() == want.stride()
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("case", ["linear", "matmul_batched", "softmax"])
def test_composites_with_a_gradient_break_up_and_train_as_on_the_cpu(session, case):
    fn, args = _composites()[case]
    cpu = [a.clone().requires_grad_() for a in args]
    remote = [a.to("rgpu").requires_grad_() for a in args]
    out, out_r = fn(*cpu), fn(*remote)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
    out.backward(g)
    out_r.backward(g.to("rgpu"))
    assert torch.equal(out_r.detach().cpu(), out.detach())
    for a, r in zip(cpu, remote):
        assert torch.equal(r.grad.cpu(), a.grad)


def _sliced_cases():
    gen = torch.Generator().manual_seed(5)
    h, w, m = (torch.randn(3, 7, 32, generator=gen), torch.randn(200, 32, generator=gen),
               torch.randn(32, 9, generator=gen))  # fmt: skip
    last = lambda t: t[:, -1:]  # noqa: E731  generation's lm_head input
    swap = lambda t: t.transpose(0, 1)  # noqa: E731
    return {  # (fn, batched input, how it is viewed, weight, weight first, weight requires grad):
        # batch dims that do not merge without a copy, times a weight
        "linear_last_position": (F.linear, h, last, w, False, True),
        "linear_transposed_batch": (F.linear, h, swap, w, False, True),
        "matmul_last_position": (torch.matmul, h, last, m, False, True),
        "matrix_times_batch": (
            torch.matmul,
            h,
            lambda t: t.transpose(1, 2)[:, :, :5],
            m.t(),
            True,
            True,
        ),  # fmt: skip
        "weight_without_grad": (F.linear, h, last, w, False, False),
    }


@pytest.mark.parametrize("case", list(_sliced_cases()))
def test_without_grad_a_weight_that_requires_grad_folds_as_on_the_cpu(session, case):
    """PyTorch's matmul folds a batched input times a weight that requires grad into one mm even
    with grad disabled; a server tensor never requires grad, so that call breaks up on the client
    and rounds exactly as local torch (it went whole and ran bmm: 2e-6 off)."""
    fn, h, view, w, weight_first, requires_grad = _sliced_cases()[case]
    w_cpu = w.clone().requires_grad_(requires_grad)
    w_r = w.to("rgpu").requires_grad_(requires_grad)
    x_cpu, x_r = view(h), view(h.to("rgpu"))
    assert x_r.stride() == x_cpu.stride()
    with torch.no_grad():
        if weight_first:
            want, got = fn(w_cpu, x_cpu), fn(w_r, x_r)
        else:
            want, got = fn(x_cpu, w_cpu), fn(x_r, w_r)
    assert got.shape == want.shape and got.stride() == want.stride()
    assert torch.equal(got.cpu(), want)


def _rnns():
    return {
        "lstm_two_layers": lambda: torch.nn.LSTM(8, 16, num_layers=2),
        "lstm_bidirectional_batch_first": lambda: torch.nn.LSTM(
            8, 16, bidirectional=True, batch_first=True
        ),
        "lstm_projected": lambda: torch.nn.LSTM(8, 16, proj_size=4),
        "gru_two_layers": lambda: torch.nn.GRU(8, 16, num_layers=2),
        "rnn_relu_no_bias": lambda: torch.nn.RNN(8, 16, nonlinearity="relu", bias=False),
    }


def _flat(out) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


@pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN")
@pytest.mark.parametrize("case", list(_rnns()))
def test_recurrent_layers_without_grad_go_whole_and_equal_the_cpu(session, case):
    """Broken up, an LSTM was a few messages per time step, ~100x slower than the CPU, and 7e-8
    off (CPU inference runs oneDNN's kernel, chosen by grad mode)."""
    torch.manual_seed(0)
    model = _rnns()[case]()
    sent = []
    for steps in (5, 50):
        x = torch.randn(steps, 3, 8)
        with torch.no_grad():
            want = _flat(model.cpu()(x))
            model.to("rgpu")
            x_r = x.to("rgpu")
            torch.rgpu.synchronize()
            m0 = rgpu.stats()["messages"]
            got = _flat(model(x_r))
            torch.rgpu.synchronize()
        sent.append(rgpu.stats()["messages"] - m0)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.stride() == w.stride()
            assert torch.equal(g.cpu(), w)
    # the initial states, the layer itself and the synchronize, however long the sequence
    assert sent[0] == sent[1] <= 5, sent


def test_packed_sequences_run_on_rgpu_as_on_the_cpu(session):
    """`pack_padded_sequence` of an rgpu tensor raised ("batch_sizes should always be on CPU")."""
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    torch.manual_seed(0)
    model = torch.nn.LSTM(8, 16, num_layers=2)
    x, lengths = torch.randn(20, 4, 8), torch.tensor([20, 13, 7, 2])
    h0, c0 = torch.randn(2, 4, 16), torch.randn(2, 4, 16)
    with torch.no_grad():
        want, (h, c) = model(pack_padded_sequence(x, lengths), (h0, c0))
        model.to("rgpu")
        packed = pack_padded_sequence(x.to("rgpu"), lengths)
        assert packed.batch_sizes.device.type == "cpu"
        got, (hg, cg) = model(packed, (h0.to("rgpu"), c0.to("rgpu")))
    assert torch.equal(got.batch_sizes, want.batch_sizes)
    assert torch.equal(pad_packed_sequence(got)[0].cpu(), pad_packed_sequence(want)[0])
    assert torch.equal(hg.cpu(), h) and torch.equal(cg.cpu(), c)
    # with a gradient, through the packing too
    x_r = x.to("rgpu").requires_grad_()
    out, _ = model(pack_padded_sequence(x_r, lengths))
    pad_packed_sequence(out)[0].square().sum().backward()
    model.cpu()
    x_c = x.clone().requires_grad_()
    out, _ = model(pack_padded_sequence(x_c, lengths))
    pad_packed_sequence(out)[0].square().sum().backward()
    torch.testing.assert_close(x_r.grad.cpu(), x_c.grad, rtol=1e-5, atol=1e-6)


def test_recurrent_layers_with_grad_mode_on_break_up_and_train_as_on_the_cpu(session):
    # the CPU's kernel depends on grad mode, so the whole op is only sent without it
    torch.manual_seed(0)
    model = torch.nn.GRU(8, 16)
    x = torch.randn(6, 2, 8)
    out = model(x)[0]
    out.square().sum().backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.to("rgpu")
    torch.rgpu.synchronize()
    m0 = rgpu.stats()["messages"]
    got = model(x.to("rgpu"))[0]
    assert rgpu.stats()["messages"] - m0 > 6  # broken up: per time step
    got.square().sum().backward()
    torch.testing.assert_close(got.detach().cpu(), out.detach(), rtol=1e-6, atol=1e-6)
    for p, w in zip(model.parameters(), want):
        torch.testing.assert_close(p.grad.cpu(), w, rtol=1e-5, atol=1e-5)


def test_recurrent_layers_under_autocast_run_in_its_dtype_with_grad_mode_on_or_off(session):
    """CUDA's autocast casts a whole cuDNN RNN, weights and states included. Sent whole, an LSTM
    under `torch.autocast("rgpu")` came back float32 without grad mode (bfloat16 with it)."""
    torch.manual_seed(0)
    model = torch.nn.LSTM(8, 16, num_layers=2)
    x = torch.randn(5, 3, 8)
    low = torch.nn.LSTM(8, 16, num_layers=2)
    low.load_state_dict(model.state_dict())
    low.bfloat16()
    model.to("rgpu")
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            want = _flat(low(x.bfloat16()))
            with torch.autocast("rgpu", dtype=torch.bfloat16):
                got = _flat(model(x.to("rgpu")))
        assert [g.dtype for g in got] == [torch.bfloat16] * 3
        for g, w in zip(got, want):
            if grad:  # broken up on rgpu into PyTorch's fused cells (as on CUDA): bf16 rounding
                torch.testing.assert_close(g.detach().cpu(), w.detach(), rtol=2e-2, atol=1e-2)
            else:
                assert torch.equal(g.cpu(), w)
    for p in model.parameters():
        assert p.dtype == torch.float32
