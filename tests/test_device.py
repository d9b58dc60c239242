"""The rgpu device end to end: factories, transfers, dtypes, the torch.rgpu module.

Every value is compared with the same work done on the CPU.
"""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch

import rgpu


def same(remote, expected):
    """Exact equality with a CPU reference: values, shape, dtype."""
    got = remote.cpu()
    assert got.device.type == "cpu"
    assert got.dtype == expected.dtype, (got.dtype, expected.dtype)
    assert got.shape == expected.shape, (got.shape, expected.shape)
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)


def test_readme_example(dev):
    x = torch.ones(4, device="rgpu")
    assert (x * 2).sum().item() == 8.0


def test_tensors_report_the_rgpu_device(dev):
    x = torch.zeros(2, device=dev)
    assert x.device == torch.device("rgpu", 0)
    assert x.is_rgpu and type(x) is rgpu.RemoteTensor
    assert (
        torch.rgpu.is_available()
        and torch.rgpu.device_count() == 1
        and torch.rgpu.current_device() == 0
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda d: torch.empty(0, device=d),
        lambda d: torch.zeros(3, 4, device=d),
        lambda d: torch.ones(2, 3, dtype=torch.int32, device=d),
        lambda d: torch.full((2, 2), 7.5, device=d),
        lambda d: torch.full((3,), True, device=d),
        lambda d: torch.arange(10, device=d),
        lambda d: torch.arange(0, 1, 0.125, device=d),
        lambda d: torch.arange(0, 1, 0.25, device=d),
        lambda d: torch.arange(2, 20, 3, dtype=torch.float64, device=d),
        lambda d: torch.linspace(-1, 1, 7, device=d),
        lambda d: torch.logspace(0, 2, 5, device=d),
        lambda d: torch.eye(4, device=d),
        lambda d: torch.eye(2, 5, device=d),
        lambda d: torch.tensor([1, 2, 3], device=d),
        lambda d: torch.tensor([[1.5, -2.0], [0.0, 3.25]], device=d),
        lambda d: torch.tensor(3.5, device=d),
        lambda d: torch.tensor([True, False], device=d),
        lambda d: torch.tensor([1 + 2j, -3j], device=d),
        lambda d: torch.as_tensor(np.arange(6).reshape(2, 3), device=d),
        lambda d: torch.zeros_like(torch.empty(2, 3), device=d),
        lambda d: torch.ones(2, 3).new_zeros((4,), device=d),
        lambda d: torch.empty_strided((2, 3), (1, 2), device=d).fill_(1),
        lambda d: torch.tril_indices(4, 4, device=d),
        lambda d: torch.triu_indices(3, 5, 1, device=d),
        lambda d: torch.hann_window(8, device=d),
        lambda d: torch.kaiser_window(6, device=d),
    ],
)
def test_factories_match_cpu(dev, make):
    same(make(dev), make("cpu"))


@pytest.mark.parametrize(
    "fn", ["randn", "rand", "randint", "randperm", "bernoulli", "normal", "multinomial"]
)
def test_random_factories_follow_the_seed_like_the_cpu(dev, fn):
    calls = {
        "randn": lambda d: torch.randn(3, 4, device=d),
        "rand": lambda d: torch.rand(5, device=d),
        "randint": lambda d: torch.randint(0, 10, (6,), device=d),
        "randperm": lambda d: torch.randperm(9, device=d),
        "bernoulli": lambda d: torch.bernoulli(torch.full((8,), 0.5, device=d)),
        "normal": lambda d: torch.normal(torch.zeros(4, device=d), 1.0),
        "multinomial": lambda d: torch.multinomial(torch.ones(5, device=d), 3),
    }
    torch.manual_seed(7)
    a = calls[fn](dev).cpu()
    torch.manual_seed(7)
    b = calls[fn](dev).cpu()
    torch.manual_seed(7)
    c = calls[fn]("cpu")
    assert torch.equal(a, b)
    assert torch.equal(a, c)  # a CPU server draws exactly what local CPU torch draws


def test_random_draws_leave_the_local_cpu_generator_alone(dev):
    torch.manual_seed(3)
    before = torch.random.get_rng_state()
    torch.randn(100, device=dev)
    torch.rgpu.synchronize()
    assert torch.equal(torch.random.get_rng_state(), before)


@pytest.mark.parametrize(
    "src",
    [
        lambda: torch.arange(24.0).reshape(2, 3, 4),
        lambda: torch.arange(24.0).reshape(4, 6).t(),
        lambda: torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        lambda: torch.arange(20.0)[::3],
        lambda: torch.empty(0, 3),
        lambda: torch.tensor(5.0),
        lambda: torch.randn(3, 4)[1:, 1:3],
        lambda: torch.randn(1000, 300),  # above the inline size: chunked upload
    ],
)
def test_transfers_both_ways_keep_values_and_dense_layouts(dev, src):
    cpu = src()
    r = cpu.to(dev)
    back = r.cpu()
    assert torch.equal(back, cpu)
    if torch._prims_common.is_non_overlapping_and_dense_or_false(cpu):
        assert back.stride() == cpu.stride()  # transposed and channels_last layouts survive
    else:
        assert back.is_contiguous()  # gapped views come back compact, as from CUDA


def test_large_transfer_roundtrip_is_exact(dev):
    cpu = torch.randn(3, 1024, 1024)  # 12 MiB: several chunks each way
    assert torch.equal(cpu.to(dev).cpu(), cpu)


def test_upload_takes_the_bytes_at_the_call(dev):
    small = torch.zeros(4)
    big = torch.zeros(200_000)
    rs, rb = small.to(dev), big.to(dev)
    small.fill_(9)
    big.fill_(9)
    assert rs.sum().item() == 0 and rb.sum().item() == 0


def test_to_variants(dev):
    cpu = torch.arange(6.0).reshape(2, 3)
    r = cpu.to(dev)
    same(r.to(torch.float16), cpu.to(torch.float16))  # dtype change on the device
    assert r.to(torch.float16).device.type == "rgpu"
    same(cpu.to(dev, torch.int32), cpu.to(torch.int32))
    same(cpu.to(torch.device("rgpu:0"), non_blocking=True), cpu)
    assert r.to(dev) is r
    assert torch.equal(r.to("cpu", torch.float64), cpu.double())
    assert torch.equal(torch.from_numpy(r.numpy()), cpu)
    assert r.tolist() == cpu.tolist()
    assert np.array_equal(np.asarray(r), cpu.numpy())
    same(cpu.rgpu(), cpu)
    with pytest.raises(RuntimeError, match="rgpu:0"):
        cpu.to("rgpu:1")


ALL_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool, torch.uint16,
    torch.uint32, torch.uint64,
]  # fmt: skip


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_roundtrips_and_computes(dev, dtype):
    base = torch.arange(-3, 9).reshape(3, 4)
    if dtype.is_complex:
        cpu = (base + 1j * base.flip(0)).to(dtype)
    else:
        cpu = base.clamp(min=0 if not dtype.is_signed and not dtype.is_floating_point else -3).to(
            dtype
        )
    r = cpu.to(dev)
    same(r, cpu)
    same(r.t().contiguous(), cpu.t().contiguous())
    same(torch.cat([r, r]), torch.cat([cpu, cpu]))
    if dtype not in (torch.bool, torch.uint16, torch.uint32, torch.uint64):
        same(r + r, cpu + cpu)
        same(r.sum(0), cpu.sum(0))


def test_float8_roundtrips(dev):
    cpu = torch.tensor([0.5, -1.0, 2.0]).to(torch.float8_e4m3fn)
    assert torch.equal(cpu.to(dev).cpu().float(), cpu.float())


def test_conjugate_and_negative_bits(dev):
    cpu = torch.tensor([1 + 2j, 3 - 4j, -5j])
    r = cpu.to(dev)
    c = r.conj()
    assert c.is_conj()
    same(c, cpu.conj().resolve_conj())
    same(c.imag, cpu.conj().imag)
    same(c * 2, cpu.conj() * 2)
    same(torch._neg_view(r), torch._neg_view(cpu).resolve_neg())
    same(r.conj().resolve_conj(), cpu.conj().resolve_conj())
    same(torch.view_as_real(r), torch.view_as_real(cpu))


def test_scalars_item_bool_int_float(dev):
    r = torch.tensor([2.5, -1.0], device=dev)
    assert r[0].item() == 2.5 and isinstance(r[0].item(), float)
    assert torch.tensor(7, device=dev).item() == 7
    assert bool(r[0] > 0) is True and int(r[0]) == 2 and float(r[1]) == -1.0
    assert (1 + 2j) == torch.tensor(1 + 2j, device=dev).item()
    if r.sum() > 1:
        pass
    else:
        pytest.fail("bool(tensor) gave the wrong answer")
    assert f"{r.sum():.2f}" == "1.50"


def test_cpu_scalar_tensors_and_python_numbers_mix_in(dev):
    cpu = torch.arange(5.0)
    r = cpu.to(dev)
    same(r * torch.tensor(2.5), cpu * torch.tensor(2.5))
    same(r + 1, cpu + 1)
    same(r.half() + 1.5, cpu.half() + 1.5)  # a Python float does not promote a half tensor
    same(r[0].half() * 1e-3, cpu[0].half() * 1e-3)
    same(torch.tensor([True, False], device=dev) + 1, torch.tensor([True, False]) + 1)
    same(
        torch.tensor([1, 2], dtype=torch.int8, device=dev) * 3,
        torch.tensor([1, 2], dtype=torch.int8) * 3,
    )


def test_mixing_a_cpu_tensor_is_an_error_like_cuda(dev):
    with pytest.raises(RuntimeError, match="rgpu"):
        torch.ones(3, device=dev) + torch.ones(3)


def test_repr_and_print_fetch_once(dev, counted):
    r = torch.tensor([[1.0, 2.0], [3.0, 4.0]], device=dev)
    torch.rgpu.synchronize()
    before = rgpu.stats()["waits"]
    text = repr(r)
    assert rgpu.stats()["waits"] - before == 1
    assert "device='rgpu:0'" in text and "3." in text
    g = torch.ones(2, device=dev, requires_grad=True)
    assert "requires_grad=True" in repr(g)
    assert "grad_fn=<SumBackward0>" in repr(g.sum())


def test_format_is_the_cpus(dev):
    """f"{loss}" prints the number, as on the CPU and CUDA (it printed the tensor's repr)."""
    for value in (
        torch.tensor(2.5),
        torch.tensor(7),
        torch.tensor(True),
        torch.tensor(1.0, requires_grad=True),
    ):
        r = value.to(dev)
        for spec in ("", ".3f", ">8", "e"):
            if spec in ("", ">8") or value.is_floating_point():
                assert format(r, spec) == format(value, spec)
    v, r = torch.arange(3.0), torch.arange(3.0, device=dev)
    assert f"{r}" == str(r) and f"{v}" == str(v)
    with pytest.raises(TypeError):
        format(v, ".3f")
    with pytest.raises(TypeError):
        format(r, ".3f")


def test_deepcopy_and_pickle(dev):
    r = torch.arange(4.0, device=dev)
    c = copy.deepcopy(r)
    c.add_(10)
    same(r, torch.arange(4.0))
    same(c, torch.arange(4.0) + 10)
    p = torch.nn.Parameter(torch.ones(3, device=dev))
    pc = copy.deepcopy(p)
    assert isinstance(pc, torch.nn.Parameter) and pc.requires_grad
    loaded = pickle.loads(pickle.dumps(r))
    assert torch.equal(loaded, torch.arange(4.0))  # pickled as CPU data


def test_torch_rgpu_module_reports_the_server(dev, session):
    assert torch.rgpu.get_device_name() == session.device_name
    assert "CPU" in torch.rgpu.get_device_name()
    before = torch.rgpu.memory_allocated()
    keep = torch.empty(1024, 1024, device=dev)  # 4 MiB
    assert torch.rgpu.memory_allocated() - before == 4 * 1024 * 1024
    del keep
    torch.rgpu.synchronize()
    assert torch.rgpu.memory_allocated() == before
    torch.rgpu.set_device(0)
    with pytest.raises(ValueError):
        torch.rgpu.set_device(1)


def test_matmul_reductions_and_nn_functional(dev):
    torch.manual_seed(0)
    a, b = torch.randn(8, 5), torch.randn(5, 3)
    ra, rb = a.to(dev), b.to(dev)
    torch.testing.assert_close((ra @ rb).cpu(), a @ b)
    torch.testing.assert_close(
        torch.nn.functional.softmax(ra, -1).cpu(), torch.nn.functional.softmax(a, -1)
    )
    torch.testing.assert_close(ra.std(0).cpu(), a.std(0))
    vals, idx = ra.max(1)
    torch.testing.assert_close(vals.cpu(), a.max(1).values)
    assert torch.equal(idx.cpu(), a.max(1).indices)
    torch.testing.assert_close(torch.linalg.svdvals(ra).cpu(), torch.linalg.svdvals(a))
    torch.testing.assert_close(torch.fft.rfft(ra).cpu(), torch.fft.rfft(a))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8])
def test_histc_counts_integers_as_cuda_does(dev, dtype):
    """On an accelerator transformers counts tokens per expert with `histc` of integer ids, which
    the CPU kernel refuses and CUDA's takes: every rgpu server counts them as CUDA does (bins in
    integer arithmetic, the top edge in the last bin, values outside the range not counted)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 50, (300,), generator=gen, dtype=torch.int64).to(dtype)
    for bins, lo, hi in [(7, 0, 6), (10, 0, 49), (4, 3, 20), (5, 0, 0), (3, 10.9, 30.2)]:
        want = torch.histc(x.double(), bins, int(lo), int(hi)).to(dtype)
        got = torch.histc(x.to(dev), bins, lo, hi)
        assert got.dtype == dtype
        assert torch.equal(got.cpu(), want), (bins, lo, hi)
    assert torch.equal(torch.histc(x.to(dev), 4, 60, 70).cpu(), torch.zeros(4, dtype=dtype))
    same = torch.full((5,), 7, dtype=dtype)  # one value: the range widens to [6, 8], as on CUDA
    assert torch.histc(same.to(dev), 3).cpu().tolist() == [0, 5, 0]
    floats = torch.randn(100, generator=gen)
    assert torch.equal(torch.histc(floats.to(dev), 6, -1, 1).cpu(), torch.histc(floats, 6, -1, 1))


_X = torch.tensor([[1.5, -2.0, 3.0], [4.0, 0.5, -6.0]])
_S = torch.tensor(2.0)  # a CPU scalar: CUDA kernels take it beside device tensors


@pytest.mark.parametrize(
    "f",
    [
        lambda x: x.masked_fill(x > 0, _S),
        lambda x: x.clone().masked_fill_(x > 0, _S),
        lambda x: _S // x,
        lambda x: torch.div(_S, x, rounding_mode="floor"),
        lambda x: torch.copysign(_S, x),
        lambda x: torch.copysign(x, -_S),
        lambda x: x.clone().index_fill_(1, torch.tensor([0, 2], device=x.device), _S),
        lambda x: torch.where(x > 0, x, _S),
    ],
    ids=[
        "masked_fill",
        "masked_fill_",
        "rfloordiv",
        "div_floor",
        "copysign",
        "copysign_r",
        "index_fill_",
        "where",
    ],
)
def test_cpu_scalar_tensors_mix_with_rgpu_tensors_as_with_cuda(dev, f):
    got, want = f(_X.to(dev)), f(_X)
    assert got.dtype == want.dtype and got.stride() == want.stride()
    assert torch.equal(got.cpu(), want)


def test_the_default_device_set_to_rgpu_leaves_rgpus_own_host_buffers_on_the_cpu(dev):
    """`torch.set_default_device("rgpu")` sends every factory call without a device to rgpu,
    rgpu's own among them: the buffers downloads land in were made on rgpu, and a generate's
    stop check, `x.to("cpu", non_blocking=True)` and `torch.load(map_location=...)` failed
    ("byte_view needs a contiguous CPU tensor")."""
    import io

    import torch.nn.functional as F

    q, k, v = (torch.randn(1, 2, 5, 4) for _ in range(3))
    saved = io.BytesIO()
    torch.save({"w": torch.arange(6.0).reshape(2, 3)}, saved)
    torch.set_default_device(dev)
    try:
        x = torch.arange(6.0).reshape(2, 3)
        assert x.device.type == "rgpu"
        assert x.t().cpu().tolist() == [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]]
        copied = x.to("cpu", non_blocking=True)
        torch.rgpu.synchronize()
        assert copied.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
        assert torch.empty(0).cpu().shape == (0,)
        attended = F.scaled_dot_product_attention(q.to(dev), k.to(dev), v.to(dev), is_causal=True)
        saved.seek(0)
        loaded = torch.load(saved, map_location=dev)["w"]
    finally:
        torch.set_default_device(None)
    assert torch.equal(attended.cpu(), F.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert loaded.device.type == "rgpu" and loaded.cpu().tolist() == x.cpu().tolist()
