"""Pickling rgpu tensors: `torch.save` writes what it writes for the same CPU tensors, byte for
byte, shared storages included; `copy.copy` aliases, as on the CPU."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch import nn


def shared_tensors(device: str) -> dict:
    torch.manual_seed(0)
    x = torch.randn(4, 6).to(device)
    return {
        "x": x,
        "view": x[1:3, ::2],
        "transposed": x.t(),
        "again": x,
        "expanded": x[0].expand(3, 6),
        "other": torch.arange(5.0).to(device),
    }


def saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_torch_save_writes_the_cpus_bytes_with_storages_shared(dev):
    on_rgpu, on_cpu = saved(shared_tensors(dev)), saved(shared_tensors("cpu"))
    # each storage once: a view and its base were two downloads, two storages in the file
    assert on_rgpu == on_cpu

    for where in ("cpu", dev):
        back = torch.load(io.BytesIO(on_rgpu), map_location=where, weights_only=True)
        ref = shared_tensors("cpu")
        for name, t in back.items():
            assert t.device.type == torch.device(where).type
            assert (t.shape, t.stride(), t.storage_offset()) == (
                ref[name].shape,
                ref[name].stride(),
                ref[name].storage_offset(),
            ), name
            assert torch.equal(t.cpu(), ref[name]), name
        assert back["again"] is back["x"]
        back["x"][1, 2] = 100.0  # the view came back a view: the write shows in it
        assert back["view"][0, 1].item() == 100.0
        assert back["transposed"][2, 1].item() == 100.0


def test_saving_views_of_one_storage_as_two_dtypes_is_refused_as_on_the_cpu(dev):
    for device in ("cpu", dev):
        x = torch.ones(4, device=device)
        with pytest.raises(RuntimeError, match="view the same data as different types"):
            saved([x, x.view(torch.int32)])


def test_a_pickled_model_loads_with_parameters(dev):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).to(dev)
    expected = {k: v.cpu() for k, v in model.state_dict().items()}
    for where in ("cpu", dev):
        back = torch.load(io.BytesIO(saved(model)), map_location=where, weights_only=False)
        for name, p in back.named_parameters():
            assert isinstance(p, nn.Parameter) and p.requires_grad, name
            assert torch.equal(p.detach().cpu(), expected[name])
        assert not isinstance(back[1].running_mean, nn.Parameter)
        assert torch.equal(back[1].running_var.cpu(), expected["1.running_var"])


def test_pickle_outside_torch_save(dev):
    x = torch.arange(12.0, device=dev).reshape(3, 4)
    back = pickle.loads(pickle.dumps([x, x[:, 1]]))
    assert back[1].storage_offset() == 1 and back[1].stride() == (4,)
    assert torch.equal(back[0], torch.arange(12.0).reshape(3, 4))
    assert torch.equal(back[1], torch.tensor([1.0, 5.0, 9.0]))


def test_copy_copy_aliases_on_the_device(dev):
    x = torch.zeros(3, device=dev)
    y = copy.copy(x)
    assert y is not x and y.device == x.device
    y[0] = 5.0
    assert x.tolist() == [5.0, 0.0, 0.0]
    p = nn.Parameter(torch.ones(2, device=dev))
    q = copy.copy(p)
    assert isinstance(q, nn.Parameter) and q.requires_grad and q.device == p.device
    assert q.data_ptr() == p.data_ptr()


def test_a_cpu_checkpoint_with_scalars_loads_onto_rgpu(dev):
    """0-dim tensors (BatchNorm's `num_batches_tracked`, Adam's `step`) failed to load with
    `map_location="rgpu"` ("dense_strides() missing 1 required positional argument")."""
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 3), torch.randn(8, 1)

    def step(m, o, device):
        o.zero_grad()
        loss = nn.functional.mse_loss(m(x.to(device)), y.to(device))
        loss.backward()
        o.step()
        return loss.detach().cpu()

    step(model, opt, "cpu")
    ckpt = saved({"model": model.state_dict(), "opt": opt.state_dict(), "epoch": torch.tensor(3)})

    back = torch.load(io.BytesIO(ckpt), map_location=dev, weights_only=True)
    assert back["epoch"].device.type == "rgpu" and back["epoch"].item() == 3
    assert back["model"]["1.num_batches_tracked"].item() == 1
    remote = copy.deepcopy(model).to(dev)
    remote.load_state_dict(back["model"])
    remote_opt = torch.optim.Adam(remote.parameters(), lr=0.01)
    remote_opt.load_state_dict(back["opt"])
    for _ in range(2):
        torch.testing.assert_close(step(remote, remote_opt, dev), step(model, opt, "cpu"))
    for r, c in zip(remote.state_dict().values(), model.state_dict().values()):
        torch.testing.assert_close(r.cpu(), c)


def test_a_checkpoint_costs_one_wait(dev):
    """The tensors of a state dict, an optimizer's and a module are downloaded together (one
    wait per tensor was a second per hundred tensors over a 10 ms link)."""
    import rgpu

    torch.manual_seed(5)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)]).to(dev)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8, device=dev)).sum().backward()
    opt.step()
    torch.rgpu.synchronize()
    for obj in (model.state_dict(), {"model": model.state_dict(), "opt": opt.state_dict()}, model):
        before = rgpu.stats()["waits"]
        data = saved(obj)
        assert rgpu.stats()["waits"] - before == 1
        back = torch.load(io.BytesIO(data), weights_only=False)
        expected = obj if not isinstance(obj, nn.Module) else obj.state_dict()
        got = back if not isinstance(back, nn.Module) else back.state_dict()
        for (name, a), (_, b) in zip(pytree_items(expected), pytree_items(got), strict=True):
            assert torch.equal(a.cpu(), b), name


def pytree_items(obj) -> list:
    import torch.utils._pytree as pytree

    leaves, _ = pytree.tree_flatten_with_path(obj)
    return [(pytree.keystr(k), v) for k, v in leaves if isinstance(v, torch.Tensor)]


def test_deepcopy_keeps_views_and_copies_parameters_as_the_cpu_does(dev):
    def tree(device: str) -> dict:
        x = torch.arange(12.0, device=device).view(3, 4)
        p = nn.Parameter(torch.ones(2, 3, device=device))
        p.grad = torch.full((2, 3), 2.0, device=device)
        return {"x": x, "view": x[:, ::2], "t": x.t(), "p": p, "p_data": p.detach()}

    for device in ("cpu", dev):
        original = tree(device)
        c = copy.deepcopy(original)
        c["x"][0, 0] = 100.0  # the copied views view the copied base
        assert c["view"][0, 0].item() == 100.0 and c["t"][0, 0].item() == 100.0, device
        assert original["x"][0, 0].item() == 0.0
        assert (c["view"].stride(), c["view"].storage_offset()) == ((4, 2), 0)
        assert isinstance(c["p"], nn.Parameter) and c["p"].requires_grad
        assert c["p"].grad is None  # nn.Parameter's deepcopy leaves the gradient behind
        assert c["p_data"].data_ptr() != c["p"].data_ptr()
    with pytest.raises(RuntimeError, match="graph leaves"):
        copy.deepcopy(torch.ones(2, device=dev, requires_grad=True) * 2)


def test_a_deepcopied_module_runs_its_own_weights_under_compile(dev):
    """The copy of a parameter torch.compile had traced kept its cached handle: the compiled
    function ran the copy with the original's weights, with no error."""
    import rgpu

    model = nn.Linear(3, 1, bias=False).to(dev)
    run = torch.compile(lambda m, x: m(x), backend=rgpu.compile_backend())
    x = torch.ones(1, 3, device=dev)
    run(model, x)
    best = copy.deepcopy(model)
    with torch.no_grad():
        best.weight.fill_(1.0)
    assert run(best, x).item() == 3.0
    assert run(model, x).item() == pytest.approx(model.weight.sum().item())
