"""Several devices on one server: `rgpu-server --device cpu --virtual-devices 4` as rgpu:0..3.

A real server process; values are checked against the CPU. The device API mirrors torch.cuda,
copies between devices run on the server, and a module split across devices trains as on one.
"""

from __future__ import annotations

import copy

import pytest
import torch
from rgpu_test_servers import ServerProcess

import rgpu


@pytest.fixture(scope="module")
def four():
    srv = ServerProcess("--virtual-devices", "4")
    yield srv
    rgpu.disconnect()
    srv.stop()


@pytest.fixture
def devs(four):
    rgpu.connect(four.url)
    torch.rgpu.set_device(0)
    yield four
    torch.rgpu.set_device(0)
    for i in range(4):
        try:
            torch.rgpu.synchronize(i)
        except rgpu.RemoteError:
            pass
    rgpu.disconnect()


def test_the_device_api_counts_names_and_selects_devices(devs):
    assert torch.rgpu.device_count() == 4
    names = [torch.rgpu.get_device_name(i) for i in range(4)]
    assert all("CPU" in n for n in names) and len(set(names)) == 4
    assert [d["device"] for d in rgpu.device_list()] == [f"rgpu:{i}" for i in range(4)]
    assert torch.rgpu.current_device() == 0
    torch.rgpu.set_device(2)
    assert torch.rgpu.current_device() == 2
    assert torch.ones(2, device="rgpu").device == torch.device("rgpu", 2)  # "rgpu": current
    with torch.rgpu.device(3):
        assert torch.rgpu.current_device() == 3
        assert torch.zeros(1, device="rgpu").device == torch.device("rgpu", 3)
        x = torch.arange(4.0, device="rgpu:1")  # an explicit index wins
    assert torch.rgpu.current_device() == 2
    assert x.device == torch.device("rgpu", 1)
    # an op runs on its tensors' device, whatever the current one
    y = (x * 2).sum(0, keepdim=True)
    assert y.device == torch.device("rgpu", 1)
    assert y.item() == 12.0


def test_rgpu_without_an_index_is_the_current_device_in_every_call(devs):
    """PyTorch resolves an index-less device in C++ for these (its guard for a Python backend
    always answers 0): they landed on rgpu:0 whatever the current device."""
    data = [[1.0, 2.0], [3.0, 4.0]]
    cpu = torch.tensor(data)
    x1 = torch.tensor(data, device="rgpu:1")
    torch.rgpu.set_device(1)
    here = torch.device("rgpu", 1)
    made = {
        "to(str)": cpu.to("rgpu"),
        "to(device)": cpu.to(torch.device("rgpu")),
        "to(device, dtype)": cpu.to(torch.device("rgpu"), torch.float64),
        "to(device=)": cpu.to(device="rgpu", non_blocking=True),
        "tensor": torch.tensor(data, device="rgpu"),
        "as_tensor": torch.as_tensor(data, dtype=torch.float32, device="rgpu"),
        "as_tensor(device=)": torch.as_tensor(cpu, device=torch.device("rgpu")),
        "new_tensor": cpu.new_tensor(data, device="rgpu"),
        "module.to": torch.nn.Linear(2, 2).to("rgpu").weight,
    }
    for what, t in made.items():
        assert t.device == here, what
    for what in ("to(str)", "to(device)", "to(device, dtype)", "tensor", "new_tensor"):
        assert made[what].cpu().tolist() == data, what
    assert x1.to("rgpu") is x1  # already there: no copy, as on CUDA
    with torch.rgpu.device(2):
        assert cpu.to("rgpu").device == torch.device("rgpu", 2)
    torch.rgpu.set_device(0)
    assert cpu.to("rgpu").device == torch.device("rgpu", 0)
    assert x1.to("rgpu").device == torch.device("rgpu", 0)
    assert cpu.to("cpu") is cpu and cpu.to(torch.float64).dtype == torch.float64


def test_torchscript_and_compile_see_pytorchs_own_calls_after_a_device_switch(devs):
    """The wrappers that fill in the current device stand for PyTorch's functions in the
    compilers: TorchScript knows them as the same aten ops, torch.compile traces no break."""
    # rgpu marks its own modules for Dynamo to skip at its first graph on rgpu
    torch.compile(lambda t: t * 2, backend=rgpu.compile_backend())(torch.ones(2, device="rgpu"))
    torch.rgpu.set_device(1)

    def f(x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.float64) + torch.tensor([1.0, 2.0], dtype=torch.float64)

    x = torch.ones(2)
    assert torch.jit.script(f)(x).tolist() == [2.0, 3.0]
    torch._dynamo.reset()
    try:
        compiled = torch.compile(f, backend="eager", fullgraph=True)
        assert compiled(x).tolist() == [2.0, 3.0]
    finally:
        torch._dynamo.reset()


def test_device_contexts_and_lazy_modules_after_a_device_switch(devs):
    """The current-device wrappers stand for PyTorch's functions where PyTorch finds them by
    identity: `torch.tensor` under `torch.device("meta")` made CPU tensors once a device switch
    had put them in, so transformers' `from_pretrained` on the CPU (which asks
    `torch.tensor([]).device`) skipped initialising its rotary buffers: garbage logits, no error."""
    torch.rgpu.set_device(1)
    torch.rgpu.set_device(0)
    # a table PyTorch fills on first use, here after the wrapping (as in a fresh kernel where
    # the first `with torch.device(...)` comes after a device switch)
    from torch.utils import _device as device_context

    device_context._device_constructors.cache_clear()
    for where, expected in (("meta", "meta"), ("rgpu:1", "rgpu:1"), ("cpu", "cpu")):
        with torch.device(where):
            made = [torch.tensor([1.0, 2.0]), torch.as_tensor([3]), torch.zeros(1)]
        assert [str(t.device) for t in made] == [expected] * 3, where
    torch.rgpu.set_device(1)
    with torch.device("rgpu"):  # the current device, as a factory under the context gives
        assert [torch.tensor([1.0]).device, torch.zeros(1).device] == [torch.device("rgpu", 1)] * 2
    torch.set_default_device("rgpu:2")
    try:
        assert torch.tensor([1.0]).device == torch.device("rgpu", 2)
        assert torch.tensor([1.0], device="rgpu").device == torch.device("rgpu", 1)
    finally:
        torch.set_default_device(None)
    assert torch.tensor([1.0]).device.type == "cpu"

    fresh = torch.nn.LazyLinear(3).to("rgpu")  # uninitialized: bound for the current device
    fresh(torch.ones(2, 4, device="rgpu"))
    assert fresh.weight.device == fresh.bias.device == torch.device("rgpu", 1)
    lazy = torch.nn.LazyLinear(3).to(torch.float64)  # `to` of an uninitialized parameter
    assert lazy(torch.ones(2, 4, dtype=torch.float64)).dtype == torch.float64
    lazy.to("rgpu")
    assert lazy.weight.device == torch.device("rgpu", 1)
    x = torch.ones(2, 4, dtype=torch.float64)
    torch.testing.assert_close(lazy(x.to("rgpu")).cpu(), lazy.to("cpu")(x), rtol=0, atol=0)


def test_memory_is_counted_per_device(devs):
    before = [torch.rgpu.memory_allocated(i) for i in range(4)]
    a = torch.empty(256, 1024, device="rgpu:1")  # 1 MiB
    b = torch.empty(512, 1024, device="rgpu:3")  # 2 MiB
    after = [torch.rgpu.memory_allocated(i) for i in range(4)]
    assert [x - y for x, y in zip(after, before)] == [0, 1 << 20, 0, 2 << 20]
    del a, b
    torch.rgpu.synchronize()
    assert [torch.rgpu.memory_allocated(i) for i in range(4)] == before


def test_each_device_has_its_own_generator(devs):
    torch.manual_seed(5)  # every device, as torch.cuda.manual_seed_all
    draws = [torch.randn(6, device=f"rgpu:{i}").cpu() for i in range(4)]
    ref = torch.randn(6, generator=torch.Generator().manual_seed(5))
    for d in draws:
        assert torch.equal(d, ref)
    with torch.rgpu.device(1):
        torch.rgpu.manual_seed(11)  # the current device only
    again = [torch.randn(6, device=f"rgpu:{i}").cpu() for i in (0, 1)]
    g = torch.Generator().manual_seed(5)
    torch.randn(6, generator=g)
    assert torch.equal(again[0], torch.randn(6, generator=g))
    assert torch.equal(again[1], torch.randn(6, generator=torch.Generator().manual_seed(11)))
    # states per device
    state = torch.rgpu.get_rng_state(2)
    first = torch.rand(3, device="rgpu:2").cpu()
    torch.rgpu.set_rng_state(state, 2)
    assert torch.equal(torch.rand(3, device="rgpu:2").cpu(), first)
    assert len(torch.rgpu.get_rng_state_all()) == 4


def test_synchronize_and_events_per_device(devs):
    x = torch.ones(64, 64, device="rgpu:2")
    start, end = torch.rgpu.Event(enable_timing=True), torch.rgpu.Event(enable_timing=True)
    with torch.rgpu.device(2):
        start.record()
        y = x @ x
        end.record()
    end.synchronize()
    assert start.query() and end.query()
    assert start.elapsed_time(end) >= 0
    torch.rgpu.synchronize(2)
    torch.rgpu.synchronize("rgpu:3")
    assert y.device == torch.device("rgpu", 2)
    assert y[0, 0].item() == 64.0


def test_copies_between_devices_stay_on_the_server(devs):
    data = torch.randn(256, 256)  # 256 KiB
    x = data.to("rgpu:0")
    torch.rgpu.synchronize(0)
    before = rgpu.stats()
    y = x.to("rgpu:1")
    z = torch.empty(256, 256, device="rgpu:2")
    z.copy_(y)
    w = z.t().to("rgpu:3")  # a transposed view keeps its layout
    torch.rgpu.synchronize(3)
    moved = {k: rgpu.stats()[k] - before[k] for k in ("bytes_out", "bytes_in", "lane_transfers")}
    assert moved["lane_transfers"] == 0
    assert moved["bytes_out"] < 2048 and moved["bytes_in"] < 256  # ops, not tensor bytes
    assert (y.device, z.device, w.device) == tuple(torch.device("rgpu", i) for i in (1, 2, 3))
    assert w.stride() == (1, 256)
    assert torch.equal(w.cpu(), data.t())
    y.add_(1)  # a copy, not an alias
    assert torch.equal(x.cpu(), data)


def test_mixing_devices_in_one_op_raises_as_cuda_does(devs):
    a = torch.ones(3, device="rgpu:0")
    b = torch.ones(3, device="rgpu:1")
    with pytest.raises(RuntimeError, match=r"same device.*rgpu:0 and rgpu:1"):
        a + b
    with pytest.raises(RuntimeError, match="same device"):
        torch.cat([a, b])
    with pytest.raises(RuntimeError, match="same device"):
        a.add_(b)
    assert torch.equal((a + b.to("rgpu:0")).cpu(), torch.full((3,), 2.0))  # after a copy: fine
    assert torch.equal((a + torch.tensor(1.0)).cpu(), torch.full((3,), 2.0))  # a CPU scalar: fine


def test_a_device_that_does_not_exist_fails_on_the_line_that_names_it(devs):
    with pytest.raises(rgpu.NoSuchDevice, match=r"rgpu:7 does not exist.*4 devices"):
        torch.ones(2, device="rgpu:7")
    x = torch.ones(2, device="rgpu:1")
    with pytest.raises(RuntimeError, match="rgpu:4 does not exist"):
        x.to("rgpu:4")
    with pytest.raises(ValueError, match="rgpu:9 does not exist"):
        torch.rgpu.set_device(9)
    with pytest.raises(rgpu.NoSuchDevice):
        torch.rgpu.device(5)
    with pytest.raises(rgpu.NoSuchDevice):
        torch.rgpu.memory_allocated(4)
    assert torch.rgpu.current_device() == 0
    assert x.sum().item() == 2.0  # nothing was sent: the session is fine


def _pipeline(devices: tuple) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(3)
    first = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    second = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return first.to(devices[0]), second.to(devices[1])


def _train(devices: tuple, steps: int = 6) -> tuple[list[float], list[torch.Tensor]]:
    first, second = _pipeline(devices)
    params = [*first.parameters(), *second.parameters()]
    opt = torch.optim.Adam(params, lr=0.01)
    g = torch.Generator().manual_seed(9)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        hidden = first(x.to(devices[0]))
        out = second(hidden.to(devices[1]))  # across devices: autograd copies the grad back
        loss = torch.nn.functional.mse_loss(out, y.to(devices[1]))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().cpu() for p in params]


def test_a_module_split_across_devices_trains_as_on_the_cpu(devs):
    losses, params = _train(("rgpu:1", "rgpu:2"))
    ref_losses, ref_params = _train(("cpu", "cpu"))
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    for p, r in zip(params, ref_params):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
    first, second = _pipeline(("rgpu:1", "rgpu:2"))
    assert {p.device for p in first.parameters()} == {torch.device("rgpu", 1)}
    assert {p.device for p in second.parameters()} == {torch.device("rgpu", 2)}


def test_backward_on_another_device_runs_in_the_calling_thread(devs):
    # PyTorch gives a Python backend one autograd device thread; rgpu turns those threads off
    w = torch.ones(3, device="rgpu:3", requires_grad=True)
    (w * w).sum().backward()
    assert w.grad.device == torch.device("rgpu", 3)
    assert torch.equal(w.grad.cpu(), torch.full((3,), 2.0))


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--device", "cpu", "--virtual-devices", "0"], "at least 1"),
        (["--devices", "cpu,cpu"], "names a device twice"),
        (["--devices", "cpu", "--virtual-devices", "2"], "do not go together"),
    ],
)
def test_device_flags_that_cannot_work_stop_the_server_with_a_reason(flags, says):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "rgpu_server", "--port", "0", "--no-preload-inductor", *flags],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode != 0
    assert says in out.stderr


def test_generate_on_another_device_reads_and_sets_back_that_devices_generator(devs):
    """The stop check runs ahead and sets the generator back past the end: on rgpu:2's."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100,
                                     n_positions=64, bos_token_id=0, eos_token_id=99,
                                     initializer_range=0.5)  # fmt: skip
    cpu = transformers.GPT2LMHeadModel(config).eval()
    model = copy.deepcopy(cpu).to("rgpu:2")
    prompt = torch.tensor([[5, 17, 3, 42]])
    kwargs = dict(max_new_tokens=12, do_sample=True, top_k=10, pad_token_id=0)
    torch.manual_seed(3)
    first = cpu.generate(prompt, **kwargs)[0, 4:]
    eos = next(int(t) for i, t in enumerate(first) if i >= 4 and int(t) not in first[:i].tolist())
    kwargs["eos_token_id"] = eos  # it stops mid-way, with steps run past the end to undo
    torch.manual_seed(3)
    expected = cpu.generate(prompt, **kwargs)
    after = torch.randn(4)
    torch.manual_seed(3)
    device0 = torch.rgpu.get_rng_state(0)
    got = model.generate(prompt.to("rgpu:2"), **kwargs)
    assert got.device == torch.device("rgpu:2")
    assert torch.equal(got.cpu(), expected)
    assert torch.equal(torch.randn(4, device="rgpu:2").cpu(), after)
    assert torch.equal(torch.rgpu.get_rng_state(0), device0)  # rgpu:0's generator untouched


def test_torch_accelerator_answers_for_rgpu(devs):
    """Libraries that know no device by name use torch.accelerator: the same devices and
    memory as torch.rgpu, where PyTorch alone would assert on a missing C++ allocator."""
    acc = torch.accelerator
    assert acc.current_accelerator().type == "rgpu" and acc.device_count() == 4
    acc.set_device_index(2)
    assert acc.current_device_index() == 2 == torch.rgpu.current_device()
    assert torch.ones(1, device="rgpu").device == torch.device("rgpu:2")
    with acc.device_index(3):
        assert acc.current_device_index() == 3
    assert acc.current_device_index() == 2
    acc.synchronize(1)
    x = torch.ones(1024, device="rgpu:1")
    assert acc.memory_allocated(1) == torch.rgpu.memory_allocated(1) >= 4096
    assert acc.memory_stats(1)["allocated_bytes.all.current"] == acc.memory_allocated(1)
    free, total = acc.get_memory_info(1)
    assert 0 < free <= total
    held = acc.memory_allocated(1)
    del x
    acc.empty_cache()  # the dropped tensor's free goes now, not with the next batch
    assert acc.memory_allocated(1) == held - 4096
    assert torch.rgpu.memory_stats(1) == acc.memory_stats(1)
    with pytest.raises(rgpu.RgpuError, match="does not track peak memory"):
        acc.max_memory_allocated(1)
    for name in ("max_memory_allocated", "max_memory_reserved", "reset_peak_memory_stats"):
        with pytest.raises(rgpu.RgpuError, match="does not track peak memory"):
            getattr(torch.rgpu, name)(1)  # as code ported from torch.cuda calls them


def test_accelerate_splits_a_model_across_devices(devs):
    """accelerate's dispatch_model with a device map over rgpu:0 and rgpu:1 (it empties the
    device cache through torch.accelerator as it places each weight)."""
    transformers = pytest.importorskip("transformers")
    accelerate = pytest.importorskip("accelerate")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128,
                                      vocab_size=200)  # fmt: skip
    cpu = transformers.LlamaForCausalLM(config).eval()
    placement = {"model.embed_tokens": "rgpu:0", "model.layers.0": "rgpu:0",
                 "model.layers.1": "rgpu:1", "model.norm": "rgpu:1", "model.rotary_emb": "rgpu:1",
                 "lm_head": "rgpu:1"}  # fmt: skip
    model = accelerate.dispatch_model(copy.deepcopy(cpu), device_map=placement)
    assert model.model.layers[1].mlp.up_proj.weight.device == torch.device("rgpu:1")
    ids = torch.randint(3, 200, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = cpu(ids).logits
        got = model(ids.to("rgpu:0")).logits.cpu()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(
        model.generate(ids.to("rgpu:0"), **kwargs).cpu(), cpu.generate(ids, **kwargs)
    )


def test_a_generator_belongs_to_its_device(devs):
    """torch.Generator("rgpu") is on the current device, as CUDA's is; each draws as a CPU
    generator with its seed, on its device, beside the devices' own generators."""
    torch.rgpu.set_device(2)
    g2 = torch.Generator(device="rgpu").manual_seed(5)
    g1 = torch.Generator(device="rgpu:1").manual_seed(6)
    assert (g2.device, g1.device) == (torch.device("rgpu", 2), torch.device("rgpu", 1))
    a = torch.randn(4, generator=g2, device="rgpu:2")
    b = torch.empty(4, device="rgpu:1").uniform_(generator=g1)
    torch.manual_seed(3)
    c = torch.rand(2, device="rgpu:1")
    assert (a.device, b.device) == (torch.device("rgpu", 2), torch.device("rgpu", 1))
    assert torch.equal(a.cpu(), torch.randn(4, generator=torch.Generator().manual_seed(5)))
    cg = torch.Generator().manual_seed(6)
    assert torch.equal(b.cpu(), torch.empty(4).uniform_(generator=cg))
    assert torch.equal(g1.get_state(), cg.get_state())  # rgpu:1's generator, where it drew
    torch.manual_seed(3)
    assert torch.equal(c.cpu(), torch.rand(2))
    with pytest.raises(rgpu.NoSuchDevice):
        torch.Generator(device="rgpu:9")
