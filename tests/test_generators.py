"""`torch.Generator(device="rgpu")`: a generator whose state lives on the server. On the CPU server
it draws what a local CPU generator with the same seed draws, so every value is compared with
one; seeding, states and drops travel in order with the ops around them."""

from __future__ import annotations

import copy
import gc
import pickle
from typing import Optional

import pytest
import torch

import rgpu
from rgpu_protocol import MAX_GENERATORS


def _draws(device: str, g: torch.Generator) -> list[torch.Tensor]:
    """The random ops that take a generator, as users call them."""
    out = [
        torch.randn(3, 4, generator=g, device=device),
        torch.rand(5, generator=g, device=device),
        torch.randint(0, 100, (6,), generator=g, device=device),
        torch.randperm(9, generator=g, device=device),
        torch.empty(7, device=device).normal_(2.0, 3.0, generator=g),
        torch.empty(7, device=device).uniform_(-1, 1, generator=g),
        torch.empty(50, device=device).bernoulli_(0.3, generator=g),
        torch.empty(6, device=device).exponential_(generator=g),
        torch.multinomial(torch.arange(1.0, 7.0, device=device), 4, generator=g),
        torch.nn.init.kaiming_uniform_(torch.empty(4, 5, device=device), generator=g),
        torch.nn.init.trunc_normal_(torch.empty(8, device=device), generator=g),
        # ops whose generator is positional in their schema
        torch.poisson(torch.arange(6.0, device=device), generator=g),
        torch.binomial(
            torch.full((5,), 10.0, device=device), torch.full((5,), 0.3, device=device), generator=g
        ),  # fmt: skip
        torch._standard_gamma(torch.arange(1.0, 5.0, device=device), generator=g),
    ]
    return [t.cpu() for t in out]


def _same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_ops_draw_from_the_generator_as_a_cpu_generator_with_that_seed(dev):
    g = torch.Generator(device=dev).manual_seed(1234)
    assert g.device == torch.device("rgpu", 0) and g.initial_seed() == 1234
    _same(_draws(dev, g), _draws("cpu", torch.Generator().manual_seed(1234)))
    # a fresh generator starts from torch's default seed, as a fresh CPU or CUDA one does
    fresh = torch.Generator(device=dev)
    assert fresh.initial_seed() == torch.Generator().initial_seed()
    assert torch.equal(torch.rand(4, generator=fresh, device=dev).cpu(),
                       torch.rand(4, generator=torch.Generator()))  # fmt: skip


def test_the_session_generator_and_a_user_generator_keep_their_own_streams(dev):
    torch.manual_seed(7)
    g = torch.Generator(device=dev).manual_seed(8)
    got = [torch.rand(3, device=dev), torch.rand(3, generator=g, device=dev),
           torch.rand(3, device=dev), torch.rand(3, generator=g, device=dev)]  # fmt: skip
    torch.manual_seed(7)
    c = torch.Generator().manual_seed(8)
    want = [torch.rand(3), torch.rand(3, generator=c), torch.rand(3), torch.rand(3, generator=c)]
    _same([t.cpu() for t in got], want)


def test_seeding_and_states_apply_in_order_with_the_ops_around_them(dev):
    g = torch.Generator(device=dev).manual_seed(3)
    c = torch.Generator().manual_seed(3)
    first = torch.randn(4, generator=g, device=dev)  # queued, not yet run, when g is re-seeded
    g.manual_seed(5)
    second = torch.randn(4, generator=g, device=dev)
    assert torch.equal(first.cpu(), torch.randn(4, generator=c))
    c.manual_seed(5)
    assert torch.equal(second.cpu(), torch.randn(4, generator=c))

    state = g.get_state()
    assert state.dtype == torch.uint8 and torch.equal(state, c.get_state())
    after = torch.rand(6, generator=g, device=dev)
    g.set_state(state)
    again = torch.rand(6, generator=g, device=dev)
    assert torch.equal(after.cpu(), again.cpu())
    assert torch.equal(after.cpu(), torch.rand(6, generator=c))

    with pytest.raises(TypeError, match="uint8"):
        g.set_state(state.float())
    g.set_state(state[:10])  # a state of the wrong size: torch's error, at the next wait
    with pytest.raises(rgpu.RemoteError, match="set_state"):
        torch.rgpu.synchronize()
    assert torch.equal(torch.rand(2, generator=g, device=dev).cpu(), torch.rand(2, generator=c))


def test_seed_negative_seeds_copies_and_pickles(dev):
    g = torch.Generator(device=dev)
    value = g.seed()
    assert g.initial_seed() == value
    a = torch.rand(3, generator=g, device=dev).cpu()
    assert torch.equal(a, torch.rand(3, generator=torch.Generator().manual_seed(value)))

    g.manual_seed(-1)  # torch wraps negative seeds to 64 bits
    assert g.initial_seed() == torch.Generator().manual_seed(-1).initial_seed()
    with pytest.raises(RuntimeError, match="expected a long"):
        g.manual_seed(1.5)

    g.manual_seed(11)
    torch.rand(5, generator=g, device=dev)
    twin = copy.deepcopy(g)
    thawed = pickle.loads(pickle.dumps(g))
    assert type(twin) is type(g) and twin.device == g.device
    want = torch.rand(4, generator=g, device=dev).cpu()
    assert torch.equal(torch.rand(4, generator=twin, device=dev).cpu(), want)
    assert torch.equal(torch.rand(4, generator=thawed, device=dev).cpu(), want)


def test_torch_generator_stays_torch_generator_for_other_devices(dev):
    cpu = torch.Generator()
    assert type(cpu) is torch._C.Generator and type(torch.Generator("cpu")) is torch._C.Generator
    assert isinstance(cpu, torch.Generator) and isinstance(
        torch.Generator(device=dev), torch.Generator
    )
    assert issubclass(torch._C.Generator, torch.Generator)
    # a CPU generator given to an rgpu op: an error on the line, as CUDA gives one
    with pytest.raises(TypeError, match=r"torch.Generator\(device='rgpu'\), not one on cpu"):
        torch.randn(3, generator=cpu, device=dev)
    with pytest.raises(NotImplementedError, match="CUDA-graph features"):
        torch.Generator(device=dev).graphsafe_get_state()

    class Tagged(torch.Generator):  # a program's own subclass stays what it was
        def __init__(self, device: str = "cpu") -> None:
            super().__init__()
            self.tag = device

    mine = Tagged("cpu").manual_seed(3)
    assert type(mine) is Tagged and isinstance(mine, Tagged) and not isinstance(cpu, Tagged)
    assert mine.tag == "cpu" and isinstance(mine, torch.Generator)
    assert torch.equal(
        torch.rand(3, generator=mine), torch.rand(3, generator=torch.Generator().manual_seed(3))
    )
    with pytest.raises(NotImplementedError, match="Tagged subclasses torch.Generator"):
        Tagged(dev)
    assert torch.equal(torch.ones(2, device=dev).cpu() + 1, torch.full((2,), 2.0))


def test_a_generator_made_before_connecting_starts_from_its_seed(server):
    rgpu.disconnect()
    g = torch.Generator(device="rgpu").manual_seed(99)
    rgpu.connect(server.url)
    assert torch.equal(torch.randn(5, generator=g, device="rgpu").cpu(),
                       torch.randn(5, generator=torch.Generator().manual_seed(99)))  # fmt: skip


def test_generators_dropped_by_the_client_are_dropped_by_the_server(dev):
    """A generator per call (diffusers' habit): the server drops each one the client drops,
    so the session never reaches its limit; kept alive, the limit is a clear error."""
    for i in range(MAX_GENERATORS + 50):
        g = torch.Generator(device=dev).manual_seed(i)
        x = torch.rand(1, generator=g, device=dev)
        del g
        gc.collect() if i % 512 == 0 else None
    assert x.item() == torch.rand(1, generator=torch.Generator().manual_seed(i)).item()

    gc.collect()
    torch.Generator(device=dev).manual_seed(0)  # sends the drops
    kept = [torch.Generator(device=dev) for _ in range(MAX_GENERATORS + 1)]
    outs = [torch.rand(1, generator=g, device=dev) for g in kept]
    with pytest.raises(rgpu.RemoteError, match=f"already holds {MAX_GENERATORS} generators"):
        outs[-1].item()
    assert outs[0].item() == torch.rand(1, generator=torch.Generator()).item()
    del kept, outs
    gc.collect()
    torch.Generator(device=dev).manual_seed(0)
    assert torch.rand(
        1, generator=torch.Generator(device=dev).manual_seed(4), device=dev
    ).item() == (torch.rand(1, generator=torch.Generator().manual_seed(4)).item())


def test_replayed_steps_draw_from_the_generator_as_plain_ones(dev, replay_on):
    def steps(device: str) -> list[torch.Tensor]:
        g = torch.Generator(device=device).manual_seed(21)
        w = torch.zeros(4, device=device)
        out = []
        for _ in range(6):
            noise = torch.randn(4, generator=g, device=device)
            w = w * 0.5 + noise
            out.append(w.sum())
        return [t.cpu() for t in out]

    _same(steps(dev), steps("cpu"))


def _scripted(x: torch.Tensor, g: Optional[torch._C.Generator] = None) -> torch.Tensor:  # noqa: UP045
    return x + 1


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_torchscript_and_torch_compile_take_generators(dev):
    # TorchScript tells the generator type by identity; the C type's name still works
    assert torch.equal(torch.jit.script(_scripted)(torch.ones(2)), torch.full((2,), 2.0))

    g = torch.Generator(device=dev)

    def noisy(x: torch.Tensor) -> torch.Tensor:
        return x * 2 + torch.randn(x.shape, generator=g, device=x.device)

    compiled = torch.compile(noisy, backend=rgpu.compile_backend())
    c = torch.Generator()
    for seed in (0, 1):
        g.manual_seed(seed)
        c.manual_seed(seed)
        x = torch.arange(4.0)
        got = [compiled(x.to(dev)).cpu() for _ in range(2)]
        assert all(torch.equal(a, noisy_cpu) for a, noisy_cpu in
                   zip(got, [x * 2 + torch.randn(4, generator=c) for _ in range(2)]))  # fmt: skip


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")
def test_a_diffusers_pipeline_seeded_with_an_rgpu_generator_makes_the_cpu_images(dev):
    """diffusers' own way: `generator=torch.Generator(device).manual_seed(0)`, the initial noise
    and every ancestral step's noise drawn from it on the pipeline's device."""
    diffusers = pytest.importorskip("diffusers")

    def images(device: str, scheduler: type) -> torch.Tensor:
        torch.manual_seed(0)
        unet = diffusers.UNet2DModel(
            sample_size=16, in_channels=3, out_channels=3, layers_per_block=1,
            block_out_channels=(32, 64), down_block_types=("DownBlock2D", "AttnDownBlock2D"),
            up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=8,
        )  # fmt: skip
        pipe = diffusers.DDPMPipeline(
            unet=unet.to(device), scheduler=scheduler(num_train_timesteps=50)
        )
        pipe.set_progress_bar_config(disable=True)
        g = torch.Generator(device=device).manual_seed(0)
        out = pipe(batch_size=2, generator=g, num_inference_steps=4, output_type="np").images
        return torch.from_numpy(out)

    for scheduler in (diffusers.DDPMScheduler, diffusers.EulerAncestralDiscreteScheduler):
        got, want = images(dev, scheduler), images("cpu", scheduler)
        assert got.shape == (2, 16, 16, 3)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_a_reference_the_server_cannot_honour_is_a_clear_error_and_the_session_goes_on(session):
    """A GENERATOR reference naming a device this server lacks fails the message that names it,
    reported at the next wait; an op given it poisons its outputs with that error."""
    from rgpu_protocol import Kind, generator_ext

    session.post((Kind.GENERATOR, generator_ext(77, 9, 0), 5))
    with pytest.raises(rgpu.RemoteError, match="cannot make the generator: it names device 9"):
        torch.rgpu.synchronize()
    with pytest.raises(rgpu.RemoteError, match="cannot make the generator: it names device 9"):
        session.request((Kind.GENERATOR_STATE, generator_ext(78, 9, 0)))
    x = torch.arange(3.0, device="rgpu")
    assert torch.equal((x * 2).cpu(), torch.tensor([0.0, 2.0, 4.0]))
