"""Views, aliasing, in-place and out= ops, and the in-place ops that change metadata."""

from __future__ import annotations

import warnings

import pytest
import torch


def pair():
    cpu = torch.arange(24.0).reshape(4, 6)
    return cpu, cpu.to("rgpu")


def check(r, c):
    assert (
        r.shape == c.shape and r.stride() == c.stride() and r.storage_offset() == c.storage_offset()
    )
    assert torch.equal(r.cpu(), c)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda x: x[1].add_(100),
        lambda x: x.t().mul_(2),
        lambda x: x[:, 2:4].zero_(),
        lambda x: x.view(-1)[::5].fill_(-1),
        lambda x: x.unflatten(1, (2, 3))[..., 0].sub_(7),
        lambda x: x.chunk(2)[1].neg_(),
        lambda x: x.narrow(1, 1, 2).transpose(0, 1).clamp_(max=10),
        lambda x: x.diagonal().copy_(torch.tensor([9.0, 8.0, 7.0, 6.0], device=x.device)),
        lambda x: x.select(1, 3).index_fill_(0, torch.tensor([0, 2], device=x.device), 5.0),
        lambda x: x.unbind(0)[2].exp_(),
        lambda x: x.expand(2, 4, 6)[0].add_(0),
        lambda x: x.__setitem__((slice(None), 0), 42.0),
        lambda x: x.__setitem__(x > 20, 0.0),
    ],
)
def test_inplace_on_views_changes_the_base_as_on_cpu(dev, mutate):
    c, r = pair()
    mutate(c)
    mutate(r)
    check(r, c)


def test_inplace_ops_return_the_same_object(dev):
    _, r = pair()
    assert r.add_(1) is r
    assert r.t_() is r
    v = r[0]
    assert v.mul_(2) is v


def test_views_share_the_server_storage_after_the_base_is_gone(dev):
    c, r = pair()
    vc, vr = c[2], r[2]
    del r
    torch.rgpu.synchronize()
    vr.add_(1)
    vc.add_(1)
    assert torch.equal(vr.cpu(), vc)


def test_out_arguments_write_and_return_the_given_tensor(dev):
    c, r = pair()
    oc, orr = torch.empty(4, 6), torch.empty(4, 6, device=dev)
    assert torch.add(r, 1, out=orr) is orr
    torch.add(c, 1, out=oc)
    check(orr, oc)
    # a wrong-sized out= is resized, as on the CPU
    oc, orr = torch.empty(0), torch.empty(0, device=dev)
    torch.mul(c, 2, out=oc)
    torch.mul(r, 2, out=orr)
    check(orr, oc)
    vals_c, idx_c = torch.empty(0), torch.empty(0, dtype=torch.long)
    vals_r, idx_r = torch.empty(0, device=dev), torch.empty(0, dtype=torch.long, device=dev)
    torch.max(c, 1, out=(vals_c, idx_c))
    torch.max(r, 1, out=(vals_r, idx_r))
    check(vals_r, vals_c)
    check(idx_r, idx_c)


_AT = torch.arange(12.0).reshape(3, 4).t() / 7 - 0.5  # transposed: strides (1, 4)
_CL = (torch.arange(120.0).reshape(2, 3, 4, 5) / 50 - 1).contiguous(
    memory_format=torch.channels_last
)
_IT = torch.arange(12).reshape(3, 4).t() - 5
_RESIZED_OUT = {
    "exp": lambda x, o: torch.exp(x, out=o),
    "abs": lambda x, o: torch.abs(x, out=o),
    "sigmoid": lambda x, o: torch.sigmoid(x, out=o),
    "neg": lambda x, o: torch.neg(x, out=o),
    "add": lambda x, o: torch.add(x, x, out=o),
    "add scalar": lambda x, o: torch.add(x, 1, out=o),
    "mul": lambda x, o: torch.mul(x, 3, out=o),
    "where": lambda x, o: torch.where(x > 0, x, x * 2, out=o),
    "clamp": lambda x, o: torch.clamp(x, -0.2, 0.2, out=o),
    "pow": lambda x, o: torch.pow(x, 2, out=o),
    "lerp": lambda x, o: torch.lerp(x, x * 2, 0.3, out=o),
    "addcmul": lambda x, o: torch.addcmul(x, x, x, out=o),
    "round": lambda x, o: torch.round(x, out=o),
    "gelu": lambda x, o: torch._C._nn.gelu(x, out=o),
    "leaky_relu": lambda x, o: torch._C._nn.leaky_relu(x, out=o),
    "hardtanh": lambda x, o: torch._C._nn.hardtanh(x, out=o),
    "deg2rad": lambda x, o: torch.deg2rad(x, out=o),
    "cat": lambda x, o: torch.cat([x, x], 0, out=o),
}


def _read_through_views(r, c):
    """`r` laid out as `c`, and every view of it reading the CPU's elements."""
    check(r, c)
    assert torch.equal(r.reshape(-1).cpu(), c.reshape(-1))
    assert torch.equal(r.flatten()[:5].cpu(), c.flatten()[:5])
    assert torch.equal(r[0].cpu(), c[0])


@pytest.mark.parametrize("x", [_AT, _CL], ids=["transposed", "channels-last"])
@pytest.mark.parametrize("op", list(_RESIZED_OUT), ids=list(_RESIZED_OUT))
@pytest.mark.parametrize("given", ["empty", "wrong-size"])
def test_a_resized_out_is_laid_out_as_on_the_cpu(dev, op, x, given):
    """The CPU's kernels restride an out= tensor they resize to the layout they compute from
    the inputs (a transposed or channels-last input's); the client recorded it row-major, and
    every view of it read the wrong elements."""
    f = _RESIZED_OUT[op]
    make = (lambda d: torch.empty(0, device=d)) if given == "empty" else (
        lambda d: torch.empty(7, device=d)
    )  # fmt: skip
    c = make("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "An output with one or more elements was resized"
        f(x, c)
        r = make(dev)
        assert f(x.to(dev), r) is r
    _read_through_views(r, c)


@pytest.mark.parametrize(
    "f, dtype",
    [
        (lambda x, o: torch.eq(x, 0.1, out=o), torch.bool),
        (lambda x, o: torch.bitwise_not(x, out=o), torch.int64),
        (lambda x, o: torch.abs(x, out=o), torch.int64),
    ],
    ids=["eq", "bitwise_not", "abs"],
)
def test_a_resized_out_of_another_dtype_is_laid_out_as_on_the_cpu(dev, f, dtype):
    x = _AT if dtype == torch.bool else _IT
    c, r = torch.empty(0, dtype=dtype), torch.empty(0, dtype=dtype, device=dev)
    f(x, c)
    f(x.to(dev), r)
    _read_through_views(r, c)


@pytest.mark.parametrize(
    "f, pair_with_indices",
    [
        (lambda x, o: torch.exp(x, out=o), False),
        (lambda x, o: torch.add(x, 1, out=o), False),
        (lambda x, o: torch.sort(x, 0, out=o), True),
        (lambda x, o: torch.cat([x[:2], x[2:]], 0, out=o), False),
    ],
    ids=["exp", "add", "sort", "cat"],
)
@pytest.mark.parametrize("layout", ["transposed", "contiguous", "sliced"])
def test_an_out_of_the_right_size_keeps_its_own_layout(dev, f, pair_with_indices, layout):
    """Not resized, an out= tensor keeps its strides and offset on the CPU (sort's meta kernel
    restrided it to its input's layout)."""

    def make(d):
        if layout == "transposed":
            o = torch.zeros(3, 4, device=d).t()
        elif layout == "sliced":
            o = torch.zeros(4, 6, device=d)[:, 1:4]
        else:
            o = torch.zeros(4, 3, device=d)
        return (o, torch.zeros(o.shape, dtype=torch.long, device=d)) if pair_with_indices else o

    x = torch.arange(12.0).reshape(3, 4).t() / 5
    c, r = make("cpu"), make(dev)
    f(x, c)
    f(x.to(dev), r)
    for rr, cc in zip(r, c) if pair_with_indices else [(r, c)]:
        _read_through_views(rr, cc)


@pytest.mark.parametrize(
    "op",
    [
        lambda x: x.t_(),
        lambda x: x.transpose_(0, 1),
        lambda x: x.unsqueeze_(1),
        lambda x: x.unsqueeze_(0).squeeze_(),
        lambda x: x[:, :1].squeeze_(1),
        lambda x: x.resize_(30),
        lambda x: x.resize_(2, 3),
        lambda x: x.resize_(0),
        lambda x: x.resize_as_(torch.empty(5, 5, device=x.device)),
        lambda x: x.as_strided_((3, 3), (1, 3), 2),
        lambda x: x.swapdims_(0, 1),
        lambda x: (
            x.set_(x.new_zeros(3, 2) + 1)
            if x.device.type == "rgpu"
            else x.set_(x.new_zeros(3, 2) + 1)
        ),
        lambda x: x.t_().t_().unsqueeze_(2).squeeze_(2),
    ],
)
def test_metadata_changing_inplace_ops(dev, op):
    c, r = pair()
    op(c)
    op(r)
    assert (
        r.shape == c.shape and r.stride() == c.stride() and r.storage_offset() == c.storage_offset()
    )
    if c.numel() and op.__code__.co_consts and "resize" not in str(op.__code__.co_names):
        assert torch.equal(r.cpu(), c)
    # the tensor keeps working after its metadata changed
    c2, r2 = c.clone().fill_(1) * 3, r.clone().fill_(1) * 3
    assert torch.equal(r2.cpu(), c2)


def test_resize_then_fill_reads_back_the_grown_tensor(dev):
    c, r = pair()
    c.resize_(50).fill_(2)
    r.resize_(50).fill_(2)
    check(r, c)


@pytest.mark.parametrize(
    "fn",
    [
        lambda d: torch.tensor([1.0, 2.0, 3.0], device=d) @ torch.tensor([4.0, 5.0, 6.0], device=d),
        lambda d: (
            torch.arange(6.0, device=d).reshape(2, 3) @ torch.tensor([1.0, 0.0, 2.0], device=d)
        ),
        lambda d: torch.quantile(torch.arange(10.0, device=d), torch.tensor([0.25, 0.5], device=d)),
        lambda d: torch.quantile(torch.arange(12.0, device=d).reshape(3, 4), 0.3, dim=1),
        lambda d: torch.stft(
            torch.arange(64.0, device=d).sin(),
            16,
            window=torch.hann_window(16, device=d),
            return_complex=True,
        ),
        lambda d: torch.istft(
            torch.stft(
                torch.arange(64.0, device=d).cos(),
                16,
                window=torch.hann_window(16, device=d),
                return_complex=True,
            ),
            16,
            window=torch.hann_window(16, device=d),
        ),
    ],
)
def test_ops_the_published_rgpu_refuses_work(dev, fn):
    torch.testing.assert_close(fn(dev).cpu(), fn("cpu"))


def test_expand_broadcast_and_chunks(dev):
    c = torch.arange(3.0).reshape(3, 1)
    r = c.to(dev)
    check(r.expand(3, 4), c.expand(3, 4))
    assert torch.equal(
        (r.expand(3, 4) + torch.ones(4, device=dev)).sum(0).cpu(), (c.expand(3, 4) + 1).sum(0)
    )
    for a, b in zip(torch.arange(10.0, device=dev).chunk(3), torch.arange(10.0).chunk(3)):
        check(a, b)


@pytest.mark.parametrize(
    "make",
    [
        lambda d: torch.arange(10.0, device=d).view(5, 2) * 10,  # another shape
        lambda d: torch.ones(3, 2, device=d),  # the same shape, other values
        lambda d: torch.arange(12.0, device=d).view(3, 4).t()[1:],  # a view: shares its base
        lambda d: torch.arange(4, device=d).to(torch.float16),  # another dtype
    ],
    ids=["shape", "values", "view", "dtype"],
)
def test_assigning_data_makes_the_tensor_the_new_one_as_on_cpu(dev, make):
    # `p.data = t` copies sizes and strides at the C++ level; the server tensor stayed the old
    # one: a (5, 2) tensor that read back (3, 2), with no error
    base = {}
    for d in ("cpu", dev):
        p = torch.nn.Parameter(torch.zeros(3, 2, device=d))
        new = make(d)
        p.data = new
        new.add_(1)  # p and new are one tensor now
        base[d] = p
    c, r = base["cpu"], base[dev]
    check(r.detach(), c.detach())
    assert torch.equal((r * 2).cpu(), c * 2)
    (r.float() * r.float()).sum().backward()
    (c.float() * c.float()).sum().backward()
    assert torch.equal(r.grad.cpu(), c.grad)


def test_vector_to_parameters_writes_the_parameters(dev):
    lin_c = torch.nn.Linear(3, 2)
    lin_r = torch.nn.Linear(3, 2).to(dev)
    torch.nn.utils.vector_to_parameters(torch.arange(8.0), lin_c.parameters())
    torch.nn.utils.vector_to_parameters(torch.arange(8.0, device=dev), lin_r.parameters())
    x = torch.randn(4, 3)
    assert torch.equal(lin_r(x.to(dev)).cpu(), lin_c(x))
    assert torch.equal(lin_r.weight.detach().cpu(), lin_c.weight.detach())


def test_assigning_cpu_data_to_an_rgpu_tensor_is_refused_and_changes_nothing(dev):
    p = torch.arange(3.0, device=dev)
    with pytest.raises(RuntimeError, match=r"\.data of a tensor on rgpu.*t\.to\(p\.device\)"):
        p.data = torch.zeros(5)
    assert p.shape == (3,) and p.cpu().tolist() == [0.0, 1.0, 2.0]
