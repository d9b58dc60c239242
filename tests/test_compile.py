"""Graph shipping: torch.compile(model, backend=rgpu.compile_backend(), dynamic=False).

Compiled forward and backward graphs must equal eager results, ship one graph per direction, cost
one CALL message per graph call, recompile on a shape change, fall back to eager ops (with one
warning) for graphs the server cannot take, and be cached by the server across sessions and
server restarts.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import rgpu
import rgpu.compile as rc
from rgpu.models import TinyLM, lm_batch, seed_mlp
from rgpu_protocol import Kind, NodeRef


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def mse(model, x, y):
    return (model(x) - y).square().mean()


def train(model, loss_fn, x, y, steps, opt_cls=torch.optim.SGD, **opt_kw):
    opt = opt_cls(model.parameters(), **(opt_kw or {"lr": 0.05}))
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(model, x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_compiled_mlp_training_equals_eager_with_one_graph_per_direction(session, compiler):
    torch.manual_seed(0)
    base = seed_mlp()
    x, y = torch.randn(64, 16).to("rgpu"), torch.randn(64, 1).to("rgpu")
    eager_model = copy.deepcopy(base).to("rgpu")
    eager = train(eager_model, mse, x, y, 8)
    model = copy.deepcopy(base).to("rgpu")
    before = len(rc.SHIPPED)
    step = torch.compile(mse, backend=rgpu.compile_backend(compiler=compiler), dynamic=False)
    compiled = train(model, step, x, y, 8)
    assert len(rc.SHIPPED) - before == 2  # one forward graph, one backward graph
    tol = 0 if compiler == "eager" else 1e-5
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=tol, atol=tol)
    for p, q in zip(model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach().cpu(), rtol=tol * 10, atol=tol * 10)
    # and both are the CPU's training run
    cpu_model = copy.deepcopy(base)
    cpu = train(cpu_model, mse, x.cpu(), y.cpu(), 8)
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(cpu), rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), cpu_model.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-5, atol=1e-6)


class _SequenceReduction(torch.nn.Module):
    """SegFormer's: tokens back to an image by a permute, a strided convolution, tokens again."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(8, 8, 2, stride=2)
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, _, c = h.shape
        y = self.conv(h.permute(0, 2, 1).reshape(b, c, 8, 8))
        return self.norm(y.reshape(b, c, -1).permute(0, 2, 1))


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_graph_outputs_keep_the_layouts_the_client_traced(session, compiler):
    """The server lays the convolution's weight gradient out channels-last (its input is), where
    the client's trace said contiguous: the gradient read back was garbage (off by ~50). Outputs
    now take the traced layout on the server."""
    torch.manual_seed(0)
    cpu = _SequenceReduction()
    remote = copy.deepcopy(cpu).to("rgpu")
    compiled = torch.compile(remote, backend=rgpu.compile_backend(compiler=compiler), dynamic=False)
    h, g = torch.randn(2, 64, 8), torch.randn(2, 16, 8)
    cpu(h).backward(g)
    compiled(h.to("rgpu")).backward(g.to("rgpu"))
    for (name, p), q in zip(cpu.named_parameters(), remote.parameters()):
        assert q.grad.stride() == p.grad.stride(), name
        if compiler == "eager":  # the server runs the traced aten ops one by one
            assert torch.equal(q.grad.cpu(), p.grad), name
        else:  # Inductor fuses and reorders the arithmetic
            torch.testing.assert_close(q.grad.cpu(), p.grad, rtol=1e-4, atol=1e-5)


def test_a_compiled_step_is_four_messages_and_one_wait_per_item(session):
    torch.manual_seed(0)
    model = seed_mlp().to("rgpu")
    x, y = torch.randn(64, 16).to("rgpu"), torch.randn(64, 1).to("rgpu")
    step = torch.compile(mse, backend=rgpu.compile_backend(compiler="eager"), dynamic=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(3):  # warm up: compile and ship
        opt.zero_grad()
        step(model, x, y).backward()
        opt.step()
    torch.rgpu.synchronize()
    s0 = rgpu.stats()
    opt.zero_grad()
    loss = step(model, x, y)
    # a graph goes out with its CALL, so the server computes while the client goes on (the
    # quiet flush would have waited for a pause in the client's messages)
    assert rgpu.stats()["frames"] > s0["frames"]
    loss.backward()
    opt.step()
    s1 = rgpu.stats()
    # forward CALL, backward CALL, the ones_like that seeds backward, one foreach SGD update
    assert s1["messages"] - s0["messages"] == 4
    assert s1["waits"] == s0["waits"]
    loss.item()
    assert rgpu.stats()["waits"] - s0["waits"] == 1


def test_compiled_transformer_lm_training_equals_eager(session):
    torch.manual_seed(0)
    base = TinyLM(vocab=65, width=64, heads=4, layers=2, context=32)
    x, y = (t.to("rgpu") for t in lm_batch(65, 4, 32, torch.Generator().manual_seed(1)))

    def lm_loss(model, a, b):
        return model(a, b)[1]

    eager = train(copy.deepcopy(base).to("rgpu"), lm_loss, x, y, 5, torch.optim.AdamW, lr=3e-3)
    before = len(rc.SHIPPED)
    cm = torch.compile(
        copy.deepcopy(base).to("rgpu"),
        backend=rgpu.compile_backend(compiler="eager"),
        dynamic=False,
    )
    compiled = train(cm, lm_loss, x, y, 5, torch.optim.AdamW, lr=3e-3)
    assert len(rc.SHIPPED) - before == 2
    assert compiled == eager  # the eager server compiler runs the same kernels: bit-identical
    assert compiled[-1] < compiled[0]
    cpu = train(copy.deepcopy(base), lm_loss, x.cpu(), y.cpu(), 5, torch.optim.AdamW, lr=3e-3)
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(cpu), rtol=1e-5, atol=1e-5)


def test_backend_string_rgpu_works(session):
    torch.manual_seed(0)
    reference = seed_mlp()
    model = copy.deepcopy(reference).to("rgpu")
    x = torch.randn(8, 16)
    cm = torch.compile(model, backend="rgpu", dynamic=False)
    torch.testing.assert_close(cm(x.to("rgpu")).cpu(), reference(x))


def test_a_shape_change_recompiles_and_stays_correct(session):
    torch.manual_seed(0)
    reference = seed_mlp()
    model = copy.deepcopy(reference).to("rgpu")
    cm = torch.compile(model, backend=rgpu.compile_backend(compiler="eager"), dynamic=False)
    before = len(rc.SHIPPED)
    for batch in (8, 8, 24, 8):
        x = torch.randn(batch, 16)
        torch.testing.assert_close(cm(x.to("rgpu")).cpu(), reference(x))
    assert len(rc.SHIPPED) - before == 2  # batch 8, batch 24 (inference: forward graphs only)


def test_a_captured_cpu_tensor_travels_with_the_call(session):
    const = torch.arange(4.0)

    def f(x):
        return x * 2 + const.to(x.device)

    cf = torch.compile(f, backend=rgpu.compile_backend(compiler="eager"), dynamic=False)
    out = cf(torch.ones(4, device="rgpu"))
    torch.testing.assert_close(out.cpu(), torch.ones(4) * 2 + torch.arange(4.0))


@torch.library.custom_op("rgpu_test_compile::scaled", mutates_args=())
def scaled(x: torch.Tensor) -> torch.Tensor:
    return x * 3


@scaled.register_fake
def _(x):
    return torch.empty_like(x)


def test_a_custom_op_with_a_python_implementation_is_traced_into_aten_and_shipped(session):
    cf = torch.compile(
        lambda x: scaled(x + 1) - 1, backend=rgpu.compile_backend(compiler="eager"), dynamic=False
    )
    before = len(rc.SHIPPED)
    torch.testing.assert_close(cf(torch.ones(4, device="rgpu")).cpu(), torch.full((4,), 5.0))
    assert len(rc.SHIPPED) == before + 1


def test_unshippable_graphs_fall_back_to_eager_ops_with_one_warning(session):
    def f(x):
        return (x * x.shape[0]).sum(0)

    # symbolic shapes cannot be allocated ahead on the server: this graph runs as eager ops
    cf = torch.compile(f, backend=rgpu.compile_backend(compiler="eager"), dynamic=True)
    rc._warned.clear()
    with pytest.warns(
        UserWarning, match="eager remote ops because .*dynamic shapes; compile with dynamic=False"
    ):
        out = cf(torch.ones(5, 3, device="rgpu"))
    torch.testing.assert_close(out.cpu(), torch.full((3,), 25.0))
    out = cf(torch.ones(7, 3, device="rgpu"))  # no second warning for the same reason
    torch.testing.assert_close(out.cpu(), torch.full((3,), 49.0))


def test_shape_arithmetic_in_a_dynamic_graph_is_named_as_dynamic_shapes(session):
    """With the default dynamic=None a new shape recompiles with symbolic sizes; a graph that
    multiplies them (`s0 * s1`, a Python operator node) falls back saying why, not "it has a
    call_function node"."""

    def f(x):
        return x.reshape(x.shape[0] * x.shape[1]) * 2

    cf = torch.compile(f, backend=rgpu.compile_backend(compiler="eager"))
    rc._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in (3, 4, 5):
            x = torch.randn(n, 2)
            assert torch.equal(cf(x.to("rgpu")).cpu(), f(x))
    said = [str(w.message) for w in caught if "rgpu:" in str(w.message)]
    assert said == [
        "rgpu: running a compiled graph as eager remote ops because it has dynamic shapes; "
        "compile with dynamic=False"
    ]


def _buffer_written_inside(x):
    buf = torch.zeros(2, 4, device=x.device)  # made inside the compiled code, from no input
    buf.copy_(x[:, -4:] * 2)  # and written from one that needs grad (mamba's conv state)
    return buf, x.sin().sum()


def _transposed_buffer_written_inside(x):
    buf = torch.zeros(4, 2, device=x.device)
    buf.copy_((x[:, -4:] * 2).t())
    return buf.t(), x.sin().sum()  # an output whose gradient will come in another layout


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_backward_through_an_output_made_inside_the_graph(session, compiler):
    """AOTAutograd traced that output as a plain tensor and, in the backward, met a RemoteTensor
    tangent for it: 'we guessed its metadata incorrectly' (compiled mamba2 training failed so)."""
    x0 = torch.randn(2, 6)
    weights = torch.arange(8.0).view(2, 4)
    grads = []
    for dev, backend in (("cpu", "eager"), ("rgpu", rgpu.compile_backend(compiler=compiler))):
        torch._dynamo.reset()
        x = x0.to(dev).detach().requires_grad_()
        buf, total = torch.compile(_buffer_written_inside, backend=backend, dynamic=False)(x)
        assert buf.requires_grad
        (total + (buf * weights.to(dev)).sum()).backward()
        grads.append(x.grad.cpu())
    torch.testing.assert_close(grads[1], grads[0])


def test_backward_through_a_transposed_output_made_inside_the_graph_says_what_to_do(session):
    """Known limit: the gradient of such an output must be re-laid out as traced, and AOTAutograd
    does that on the bare meta it was given, which names no server tensor: a clear error."""
    torch._dynamo.reset()
    x = torch.randn(2, 6, device="rgpu", requires_grad=True)
    compiled = torch.compile(
        _transposed_buffer_written_inside, backend=rgpu.compile_backend(compiler="eager"),
        dynamic=False,
    )  # fmt: skip
    buf, total = compiled(x)
    with pytest.raises(RuntimeError, match=r"return that output contiguous \(.contiguous\(\)\)"):
        (total + (buf * torch.arange(8.0, device="rgpu").view(2, 4)).sum()).backward()


def _branch_on_a_sum(x):
    y = x * 2
    if y.sum() > 0:  # a graph break: the comparison's value decides which code runs
        return y + 1
    return y - 1


GRAPH_BREAKS = {
    "if on a tensor": _branch_on_a_sum,
    ".item()": lambda x: x * x.sum().item(),
    "boolean mask": lambda x: x[x > 0] * 2,
    ".tolist()": lambda x: x * len([v for v in x.tolist() if v > 0]),
}


@pytest.mark.parametrize("case", list(GRAPH_BREAKS))
def test_functions_with_graph_breaks_run_their_eager_parts_on_the_device(session, case):
    """Between its graphs, Dynamo runs the code of a graph break eagerly; its frame hook took
    rgpu's own dispatch code for user code and compiled it, so the read in the middle met a fake
    tensor and raised. rgpu's code now always runs as plain Python."""
    fn = GRAPH_BREAKS[case]
    torch.manual_seed(0)
    for x in (torch.randn(7), -torch.rand(7)):
        got = torch.compile(fn, backend=rgpu.compile_backend(), dynamic=False)(x.to("rgpu"))
        # Inductor may sum in another order than the CPU's eager kernel
        torch.testing.assert_close(got.cpu(), fn(x), rtol=1e-6, atol=1e-6)


def test_a_graph_of_cpu_tensors_stays_on_the_cpu(session):
    """compile_backend() shipped every graph, so a compiled function given CPU tensors returned
    rgpu tensors; a graph that makes an rgpu tensor from CPU inputs still runs on rgpu."""
    f = torch.compile(lambda x: x * 2 + 1, backend=rgpu.compile_backend())
    out = f(torch.ones(3))
    assert out.device.type == "cpu" and torch.equal(out, torch.full((3,), 3.0))
    g = torch.compile(lambda x: x.to("rgpu") * 2, backend=rgpu.compile_backend())
    out = g(torch.ones(3))
    assert out.device.type == "rgpu" and torch.equal(out.cpu(), torch.full((3,), 2.0))
    h = torch.compile(lambda x: x + torch.ones(3, device="rgpu"), backend=rgpu.compile_backend())
    out = h(torch.ones(3, device="rgpu"))
    assert torch.equal(out.cpu(), torch.full((3,), 2.0))


def test_a_compiled_lstm_equals_the_cpu(session):
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(4, 8, batch_first=True)
    x = torch.randn(2, 3, 4)
    compiled = torch.compile(copy.deepcopy(lstm).to("rgpu"), backend=rgpu.compile_backend())
    out, (h, c) = compiled(x.to("rgpu"))
    want, (wh, wc) = lstm(x)
    for got, exp in ((out, want), (h, wh), (c, wc)):
        torch.testing.assert_close(got.cpu(), exp, rtol=1e-5, atol=1e-6)


def test_a_backend_that_runs_graphs_here_says_so(session):
    """aot_eager runs the graph on this machine, on rgpu tensors' metadata: its outputs hold no
    data. Using one said 'Cannot copy out of meta tensor'; now the error names the backend."""
    out = torch.compile(lambda x: x * 2, backend="aot_eager")(torch.ones(3, device="rgpu"))
    with pytest.raises(RuntimeError, match="runs AOTAutograd graphs locally"):
        out.cpu()
    assert (torch.ones(3, device="rgpu") * 2).sum().item() == 6.0


def _transposed_in_place(x):
    y = x * 2
    y.t_()
    return y.contiguous()


def _unsqueezed_in_place(x):
    y = x * 2
    y.unsqueeze_(1)
    return y.sum(0)


def _resized_in_place(x):
    y = x * 2
    y.resize_(2)
    return y + 1


def _strided_in_place(x):
    y = x * 2
    y.as_strided_((2,), (2,))
    return y * 1


def _input_transposed(x):
    x.t_()
    return x + 1


def _out_resized(x):
    buf = torch.empty(0, device=x.device)
    torch.add(x, 1, out=buf)
    return buf * 2


IN_PLACE_LAYOUT_CHANGES = [
    _transposed_in_place,
    _unsqueezed_in_place,
    _resized_in_place,
    _strided_in_place,
    _input_transposed,
    _out_resized,
]


@pytest.mark.parametrize("fn", IN_PLACE_LAYOUT_CHANGES, ids=lambda f: f.__name__.strip("_"))
def test_in_place_layout_changes_inside_a_compiled_function(session, fn):
    """`y.t_(); y.contiguous()` compiled returned a (3, 2) tensor where the CPU gives (2, 3):
    while traced, an in-place op that changed the fake inner's layout left the wrapper's own
    sizes as they were, so `contiguous()` saw nothing to do. Silently wrong before the fix."""
    x = torch.arange(6.0).reshape(3, 2)
    xr = x.clone().to("rgpu")
    expected = fn(x)
    got = torch.compile(fn, backend=rgpu.compile_backend(), dynamic=False)(xr)
    assert (got.shape, got.stride()) == (expected.shape, expected.stride())
    assert torch.equal(got.cpu(), expected)
    assert (xr.shape, xr.stride()) == (x.shape, x.stride()) and torch.equal(xr.cpu(), x)


def _iadd_read(a, b):
    a += 1  # Dynamo records operator.iadd, not an in-place method
    return b * 2


def _setitem_read(a, b):
    a[0] = 5.0  # operator.setitem
    return b * 2


ALIASED_INPUTS = {
    "write the base, read a view": (lambda a, b: (a.add_(1), b * 2)[1], lambda x: (x, x[0])),
    "write a view, read the base": (lambda a, b: (b.mul_(3), a + 1)[1], lambda x: (x, x[:, 1])),
    "write a detached alias": (lambda a, b: (b.add_(1), a * 2)[1], lambda x: (x, x.detach())),
    "write the base, read its transpose": (
        lambda a, b: (a.sub_(1), b.sum(0))[1],
        lambda x: (x, x.t()),
    ),
    "disjoint rows": (lambda a, b: (a.add_(1), b * 2)[1], lambda x: (x[0], x[1])),
    "+= a detached alias": (_iadd_read, lambda x: (x, x.detach())),
    "setitem a detached alias": (_setitem_read, lambda x: (x, x.detach())),
}


@pytest.mark.parametrize("case", list(ALIASED_INPUTS))
def test_inputs_that_alias_and_are_written_give_eager_results(session, case):
    """Graph inputs sharing a storage, one written in place: the compiled graph read the other's
    old values (AOTAutograd saw no aliasing between rgpu inputs), silently wrong. Now AOTAutograd
    sees it for views and refuses a subclass graph, and a detached alias Dynamo fakes as unrelated
    is caught here: both run as eager remote ops, with one warning."""
    fn, inputs = ALIASED_INPUTS[case]
    x = torch.arange(6.0).reshape(2, 3)
    expected = fn(*inputs(x))
    xr = torch.arange(6.0).reshape(2, 3).to("rgpu")
    rc._warned.clear()
    got = torch.compile(fn, backend=rgpu.compile_backend(), dynamic=False)(*inputs(xr))
    assert torch.equal(got.cpu(), expected)
    assert torch.equal(xr.cpu(), x)


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_a_bare_torch_compile_ships_its_graphs_to_the_server(session, mode):
    """`torch.compile(model)` compiles for the rgpu device as it would for a CUDA tensor's GPU: it
    raised an error pointing to compile_backend, and transformers' own auto-compile of a static
    cache (default backend, mode="reduce-overhead") failed with it."""
    torch.manual_seed(0)
    base = seed_mlp()
    x, y = torch.randn(64, 16), torch.randn(64, 1)
    cpu = train(copy.deepcopy(base), mse, x, y, 4)
    model = copy.deepcopy(base).to("rgpu")
    before = len(rc.SHIPPED)
    step = torch.compile(mse, mode=mode)
    compiled = train(model, step, x.to("rgpu"), y.to("rgpu"), 4)
    shipped = rc.SHIPPED[before:]
    assert len(shipped) == 2  # one forward graph, one backward graph
    assert {(g.compiler, g.mode) for g in shipped} == {("inductor", mode)}
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(cpu), rtol=1e-5, atol=1e-6)
    # CPU tensors still compile here, with Inductor, as before
    torch.testing.assert_close(torch.compile(mse)(base, x, y), mse(base, x, y))


def test_inductor_options_name_the_mode_the_server_compiles_with():
    import torch._inductor

    for mode in ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"):
        want = None if mode == "default" else mode
        assert rc._mode_of(torch._inductor.list_mode_options(mode)) == want
    assert rc._mode_of(None) is None


def test_a_graph_the_server_cannot_compile_is_a_remote_error_and_the_session_goes_on(session):
    nodes = [["p"], ["c", "from_file.default", ["/etc/passwd"], {}], ["o", [NodeRef(1)]]]
    x = torch.ones(3, device="rgpu")
    session.post((Kind.COMPILE, "bad-graph", nodes, "eager", None))
    out_id = 10**13
    session.post((Kind.CALL, "bad-graph", [x], [out_id]))
    with pytest.raises(rgpu.RemoteError, match="not allowed on an rgpu server"):
        torch.rgpu.synchronize()
    assert (x + 1).sum().item() == 6.0


def test_torch_compile_right_after_connect_imports_dynamo_cleanly():
    """connect() warms up meta inference in a thread, which imports Dynamo; a torch.compile in
    the user's thread at the same moment imported it too, and one of the two failed
    (_DeadlockError, or "partially initialized module") in nearly every fresh process."""
    code = """
        import torch, rgpu
        rgpu.connect("local")
        f = torch.compile(lambda x: x * 2, backend="eager")
        print(f(torch.ones(2)).tolist())
    """
    for _ in range(2):
        out = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.strip().splitlines()[-1] == "[2.0, 2.0]"


def test_the_server_reuses_compiled_graphs_across_sessions_and_restarts(tmp_path, start_server):
    code = """
        import sys, torch, rgpu
        from rgpu.models import seed_mlp
        rgpu.connect(sys.argv[1])
        torch.manual_seed(0)
        model = seed_mlp().to("rgpu")
        x = torch.randn(8, 16).to("rgpu")
        cm = torch.compile(model, backend=rgpu.compile_backend(compiler="inductor"), dynamic=False)
        print(cm(x).sum().item())
        print(rgpu.session_info()["compile"])
    """
    cache = tmp_path / "cache"

    def run_client(url):
        out = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code), url],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        value, counters = out.stdout.strip().splitlines()[-2:]
        return float(value), eval(counters)

    srv = start_server("--compile-cache-dir", str(cache))
    v1, c1 = run_client(srv.url)
    v2, c2 = run_client(srv.url)  # a second notebook, same server: no new compile
    assert v1 == v2
    assert (
        c2["graphs_built"] == c1["graphs_built"] and c2["graphs_reused"] == c1["graphs_reused"] + 1
    )
    # a restarted server (preloading Inductor, as a standalone rgpu-server does): Inductor's
    # disk cache serves the graph
    srv = start_server("--compile-cache-dir", str(cache), "--preload-inductor")
    v3, c3 = run_client(srv.url)
    assert v3 == v1
    assert c3["graphs_built"] == 1 and c3["inductor_cache_hits"] >= 1
    assert c3["dynamo_graphs"] == 2  # the preload's and this graph: really compiled


def test_two_sessions_compiling_at_once_on_a_preloading_server_both_get_compiled_graphs(
    tmp_path, start_server
):
    # Dynamo's compile state is process-wide: two sessions' first calls at once used to fail
    # ("found no compiled frames", from fullgraph=True's process-wide count). Here two clients'
    # graphs compile at the same time, on a server that preloaded Inductor.
    code = """
        import sys, torch, rgpu
        from rgpu.models import seed_mlp
        rgpu.connect(sys.argv[1])
        torch.manual_seed(0)
        model = seed_mlp()
        x = torch.randn(int(sys.argv[2]), 16)
        expected = model(x).sum().item()
        cm = torch.compile(model.to("rgpu"), backend=rgpu.compile_backend(), dynamic=False)
        got = cm(x.to("rgpu")).sum().item()
        assert abs(got - expected) < 1e-4, (got, expected)
        print(rgpu.session_info()["compile"])
    """
    srv = start_server("--compile-cache-dir", str(tmp_path / "cache"), "--preload-inductor")
    clients = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code), srv.url, str(rows)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rows in (8, 12)  # one graph, two shapes: a compile each
    ]
    outs = [c.communicate(timeout=600) for c in clients]
    for c, (_, err) in zip(clients, outs):
        assert c.returncode == 0, err[-3000:]
    last = max((eval(out.strip().splitlines()[-1]) for out, _ in outs),
               key=lambda c: c["dynamo_graphs"])  # fmt: skip
    # one forward graph (shapes are not in the node list), built once and shared...
    assert (last["graphs_built"], last["graphs_reused"]) == (1, 1), outs
    # ...and really compiled by Dynamo for each shape, besides the preload's graph
    assert last["dynamo_graphs"] == 3, outs
    assert "Inductor preloaded" in "\n".join(srv.log_lines)


@pytest.mark.parametrize(
    "layouts",
    [{"0": 1}, [[[2, 3], [3]]], [[[2, 3], [3, 1], -1, 24]], [[[2], [1], 0, "24"]], [[2, 3]]],
    ids=["not-an-array", "three-items", "negative-offset", "bytes-not-int", "not-a-layout"],
)
def test_malformed_compile_layouts_are_protocol_errors(layouts):
    from rgpu_server.graph_messages import _layouts

    from rgpu_protocol import ProtocolError

    with pytest.raises(ProtocolError, match="layout"):
        _layouts(layouts)
    assert _layouts([None, [[2, 3], [1, 2], 0, 24]]) == (None, ((2, 3), (1, 2), 0, 24))


@torch.library.custom_op("rgpu_test_compile::by_group", mutates_args=())
def by_group(x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Scales each group of rows by its number, reading the group ends on the host (as
    transformers' grouped-mm fallback for mixture-of-experts layers does)."""
    out = torch.zeros_like(x)
    start = 0
    for i, end in enumerate(ends.cpu().tolist()):
        out[start:end] = x[start:end] * (i + 1)
        start = end
    return out


@by_group.register_fake
def _(x, ends):
    return torch.empty_like(x)


def _by_group_backward(ctx, grad):
    return by_group(grad, ctx.ends), None


def _by_group_setup(ctx, inputs, output):
    ctx.ends = inputs[1]


by_group.register_autograd(_by_group_backward, setup_context=_by_group_setup)


def _grouped(x, ends):
    return by_group(x.sin(), ends).cos().sum()


def test_a_custom_op_that_reads_its_input_on_the_host_runs_eagerly_and_compiled(session):
    """Its body's `.cpu()` reached rgpu as `aten.to` (autograd is off inside a custom op) and
    went to the server whole: `.cpu()` returned an rgpu tensor and `tolist()` recursed without
    end, eagerly and under torch.compile (where Dynamo raised instead of falling back)."""
    x, ends = torch.randn(6, 3, requires_grad=True), torch.tensor([2, 5, 6])
    _grouped(x, ends).backward()
    r = x.detach().to("rgpu").requires_grad_()
    _grouped(r, ends.to("rgpu")).backward()
    assert torch.equal(r.grad.cpu(), x.grad)
    r.grad = None
    compiled = torch.compile(_grouped, backend=rgpu.compile_backend(), dynamic=False)
    rc._warned.clear()
    with pytest.warns(UserWarning, match="eager remote ops because it calls rgpu_test_compile::"):
        loss = compiled(r, ends.to("rgpu"))
    loss.backward()
    torch.testing.assert_close(r.grad.cpu(), x.grad)
    assert torch.equal(loss.cpu(), _grouped(x.detach(), ends))


def test_a_graph_asked_for_by_two_sessions_at_once_is_built_once(monkeypatch):
    # two sessions' COMPILE of the same graph used to both miss the cache and both build it
    import threading
    import time

    from rgpu_server import graphs

    builds = []

    def slow_build(nodes, device):
        builds.append(nodes)
        time.sleep(0.3)  # wide enough that the second request arrives mid-build
        return torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph()), False

    monkeypatch.setattr(graphs, "build", slow_build)
    cache = graphs.GraphCache()
    nodes = [["placeholder", "x"], ["output", "x"]]
    got = []
    threads = [
        threading.Thread(
            target=lambda: got.append(cache.get_or_build(nodes, "eager", None, torch.device("cpu")))
        )
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1
    assert (cache.built, cache.reused) == (1, 1)
    assert got[0] is got[1]
    # a different graph still builds its own
    cache.get_or_build([["placeholder", "y"]], "eager", None, torch.device("cpu"))
    assert (cache.built, len(builds)) == (2, 2)


def test_tensors_made_on_rgpu_inside_compiled_code_come_back_as_rgpu_tensors(session):
    """A tensor the compiled code makes on rgpu from no rgpu input (a factory with
    `device=x.device`, a CPU tensor moved over) came back from the call as a bare meta tensor,
    and a module attribute set to one inside the code became one."""

    class Counter(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.count = torch.tensor(0)

        def forward(self, x, table):
            self.count = self.count.to(x.device)
            self.count.add_(3)
            z = torch.arange(2, device=x.device, dtype=x.dtype) + 1
            moved = table.to(x.device) * 2
            return (x * z * moved).sin(), z, moved, torch.zeros(2, device=x.device), x + self.count

    table = torch.tensor([5.0, 6.0])
    x_cpu = torch.tensor([0.3, 0.7], requires_grad=True)
    eager = Counter()
    want = eager(x_cpu, table)
    module = Counter()
    compiled = torch.compile(module, backend=rgpu.compile_backend("eager"), dynamic=False)
    x = x_cpu.detach().to("rgpu").requires_grad_()
    got = compiled(x, table)
    for g, w in zip(got, want):
        assert type(g) is rgpu.RemoteTensor and g.device.type == "rgpu"
        assert torch.equal(g.detach().cpu(), w.detach())
    assert type(module.count) is rgpu.RemoteTensor and module.count.cpu().item() == 3
    # and gradients flow through them as on the CPU
    (got[0].sum() + (got[1] * got[2]).sum()).backward()
    (want[0].sum() + (want[1] * want[2]).sum()).backward()
    torch.testing.assert_close(x.grad.cpu(), x_cpu.grad)
