"""Errors: local shape errors, remote failures, poisoning, and a session that keeps working."""

from __future__ import annotations

import gc
import traceback
import weakref

import pytest
import torch

import rgpu


def test_shape_error_raises_on_the_users_line_without_waiting(dev, counted):
    a, b = torch.ones(2, 3, device=dev), torch.ones(4, 5, device=dev)
    with pytest.raises(RuntimeError, match=r"reduction dim|cannot be multiplied") as info:
        a @ b
    assert "meta" not in str(info.value)
    with pytest.raises(RuntimeError, match=r"broadcast|must match the size"):
        torch.ones(3, device=dev) + torch.ones(4, device=dev)
    assert counted()["waits"] == 0


@pytest.mark.parametrize(
    "write",
    [
        lambda a, b: a.add_(b),
        lambda a, b: a.mul_(2.5),
        lambda a, b: a.sigmoid_(),
        lambda a, b: a.div_(2),
        lambda a, b: a.addcmul_(b, b),
        lambda a, b: torch.mul(a, b, out=a),
    ],
    ids=["add_", "mul_-scalar", "sigmoid_", "div_", "addcmul_", "mul-out"],
)
def test_in_place_result_that_the_tensor_cannot_hold_is_refused_at_the_op(
    dev, counted, write, request
):
    """TensorIterator's cast check: before, the op failed on the server and poisoned `a`."""
    with pytest.raises(RuntimeError) as cpu:
        write(torch.arange(3), torch.ones(3))
    a = torch.arange(3, device=dev)
    with pytest.raises(RuntimeError) as remote:
        write(a, torch.ones(3, device=dev))
    if "mul-out" in request.node.name:
        assert "cast" in str(remote.value)  # PyTorch's out= wrapper words it its own way
    else:
        assert str(remote.value) == str(cpu.value)
    assert counted()["waits"] == 0
    assert a.tolist() == [0, 1, 2]  # not poisoned
    # what the CPU allows still runs: a comparison written into an integer tensor
    assert a.lt_(torch.full((3,), 1.5, device=dev)).tolist() == [1, 1, 0]


def _remote_failure(dev):
    """An op whose failure only the server can see: a gather index out of range."""
    x = torch.arange(4.0, device=dev)
    bad_index = torch.tensor([0, 7], device=dev)
    return torch.gather(x, 0, bad_index)


def test_remote_failure_is_raised_once_at_the_next_wait_naming_the_op(dev):
    y = _remote_failure(dev)  # streams: no error yet
    z = torch.ones(2, device=dev) * 3  # unrelated work keeps streaming
    with pytest.raises(rgpu.RemoteError) as info:
        torch.rgpu.synchronize()
    err = info.value
    assert err.op == "aten::gather.default"
    assert "index" in err.remote_message.lower()
    assert "aten::gather.default failed on the rgpu server" in str(err)
    # reported once: the next wait succeeds, and unrelated tensors are fine
    torch.rgpu.synchronize()
    assert torch.equal(z.cpu(), torch.full((2,), 3.0))
    # using the poisoned tensor raises again, naming the original failure
    with pytest.raises(rgpu.RemoteError, match="gather"):
        y.cpu()
    w = y + 1  # consuming poison streams and poisons, without a second error
    torch.rgpu.synchronize()
    with pytest.raises(rgpu.RemoteError, match="gather"):
        w.sum().item()


def test_the_waited_call_that_reports_an_error_can_be_retried(dev):
    x = torch.arange(3.0, device=dev)
    _remote_failure(dev)
    with pytest.raises(rgpu.RemoteError):
        x.sum().item()
    assert x.sum().item() == 3.0


def test_unsendable_argument_fails_at_the_call_and_poisons_nothing(dev):
    g = torch.Generator()
    with pytest.raises(TypeError, match="Generator"):
        torch.rand(3, device=dev, generator=g)
    assert torch.ones(2, device=dev).sum().item() == 2.0


def test_blocked_and_unknown_ops_are_refused_by_the_server(dev, session):
    from rgpu_protocol import Kind

    x = torch.ones(2, device=dev)
    session.post((Kind.RUN, "from_file.default", ["/etc/passwd"], None, [10**12]))
    with pytest.raises(rgpu.RemoteError, match="not allowed on an rgpu server: it reads a file"):
        torch.rgpu.synchronize()
    session.post((Kind.RUN, "no_such_op.default", [x], None, [10**12 + 1]))
    with pytest.raises(rgpu.RemoteError, match="no operator aten::no_such_op"):
        torch.rgpu.synchronize()
    session.post((Kind.RUN, "os.system", ["true"], None, [10**12 + 2]))
    with pytest.raises(rgpu.RemoteError, match="no operator aten::os"):
        torch.rgpu.synchronize()
    assert x.sum().item() == 2.0


def test_tensor_ids_of_other_sessions_or_freed_ones_are_unknown(dev, session):
    from rgpu_protocol import Kind, Ref

    session.post((Kind.RUN, "add.Tensor", [Ref(987654321), 1], None, [10**12 + 3]))
    with pytest.raises(rgpu.RemoteError, match="no tensor with id 987654321"):
        torch.rgpu.synchronize()


def test_non_aten_op_without_decomposition_names_the_problem(dev):
    lib = torch.library.Library("rgpu_test_only", "DEF")
    lib.define("opaque(Tensor x) -> Tensor")
    lib.impl("opaque", lambda x: x + 1, "CPU")
    with pytest.raises(NotImplementedError, match="rgpu_test_only.opaque"):
        torch.ops.rgpu_test_only.opaque(torch.ones(2, device=dev))


def test_custom_op_with_a_python_implementation_runs(dev):
    @torch.library.custom_op("rgpu_test_only::twice_plus_one", mutates_args=())
    def twice_plus_one(x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1

    @twice_plus_one.register_fake
    def _(x):
        return torch.empty_like(x)

    r = twice_plus_one(torch.arange(3.0, device=dev))
    assert torch.equal(r.cpu(), torch.arange(3.0) * 2 + 1)


def test_sparse_results_are_refused_clearly(dev):
    with pytest.raises((NotImplementedError, rgpu.RemoteError), match="strided"):
        torch.eye(3, device=dev).to_sparse()


def test_tensors_of_an_ended_session_say_so(server):
    old = rgpu.connect(server.url)
    x = torch.ones(3, device="rgpu")
    new = rgpu.connect(server.url)
    assert new is not old
    with pytest.raises(RuntimeError, match="earlier session"):
        x + 1
    assert "ended rgpu session" in repr(x)


def test_a_failed_inplace_op_poisons_the_tensor_it_writes(dev):
    z = torch.zeros(2, device=dev)
    y = _remote_failure(dev)
    with pytest.raises(rgpu.RemoteError):
        torch.rgpu.synchronize()
    z.add_(y)  # consumes poison: must not silently leave z unchanged
    with pytest.raises(rgpu.RemoteError, match="gather"):
        z.cpu()
    w = torch.zeros(3, device=dev)
    w.index_add_(0, torch.tensor([5], device=dev), torch.ones(1, device=dev))  # fails on the server
    with pytest.raises(rgpu.RemoteError, match="index_add"):
        torch.rgpu.synchronize()
    with pytest.raises(rgpu.RemoteError, match="index_add"):
        w.cpu()


@pytest.mark.parametrize(
    "write",
    [lambda x: x.neg_(), lambda x: x.add_(1), lambda x: x.mul_(torch.ones_like(x)),
     lambda x: x.copy_(torch.ones(x.shape, device=x.device))],
    ids=["neg_", "add_", "mul_", "copy_"],
)  # fmt: skip
def test_writing_into_an_expanded_tensor_raises_at_the_op_and_keeps_its_base(dev, write):
    """The CPU refuses these before writing; meta kernels do not check, so rgpu deferred the
    refusal to the next wait and then poisoned the base, which the CPU leaves intact."""
    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
        write(torch.arange(3.0).expand(2, 3))
    base = torch.arange(3.0, device=dev)
    with pytest.raises(rgpu.RemoteError, match="more than one element of the written-to tensor"):
        write(base.expand(2, 3))
    assert torch.equal(base.cpu(), torch.arange(3.0))
    assert torch.equal((base + 1).cpu(), torch.arange(3.0) + 1)


def test_the_writes_the_cpu_allows_into_an_expanded_tensor_run_as_on_the_cpu(dev):
    for write in (lambda x: x.fill_(5), lambda x: x.zero_(), lambda x: x.masked_fill_(x > 0, 7)):
        c, r = torch.arange(3.0), torch.arange(3.0, device=dev)
        write(c.expand(2, 3))
        write(r.expand(2, 3))
        assert torch.equal(r.cpu(), c)


def test_every_waited_request_reports_a_pending_error(dev, session):
    _remote_failure(dev)
    with pytest.raises(rgpu.RemoteError, match="gather"):
        session.info()
    assert session.info()["tensors"] >= 0


def test_an_op_too_big_for_one_message_is_refused_at_the_call(dev, session):
    big_index = torch.zeros(session.max_message // 8 + 10, dtype=torch.long)
    with pytest.raises(TypeError, match="message limit"):
        torch.ones(3, device=dev)[big_index]
    assert torch.ones(2, device=dev).sum().item() == 2.0


def test_zero_tensors_from_autograd_do_not_crash_the_server(dev, session):
    # autograd makes "efficient zero tensors" for zero gradients (sgn's backward does); on the
    # server they once crashed the process for every session
    x = torch.tensor([[1.0, -2.0], [0.0, 3.0]], device=dev, requires_grad=True)
    torch.sgn(x).sum().backward()
    assert torch.equal(x.grad.cpu(), torch.zeros(2, 2))
    z = torch._efficientzerotensor((3,), device=dev)
    assert torch.equal((z + 1).cpu(), torch.ones(3))
    assert session.info()["tensors"] >= 0


def test_an_error_kept_by_the_notebook_keeps_no_argument_alive(dev):
    """IPython keeps the last error: rgpu's frames in its traceback held the failed op's
    arguments (server memory not freed, a parameter that could not be moved), where a CPU or
    CUDA op's error holds none."""
    x = torch.randn(1000, device=dev)
    alive = weakref.ref(x)
    with pytest.raises(RuntimeError, match="shape") as info:
        x.view(3, 7)
    assert "dispatch" in "".join(traceback.format_tb(info.value.__traceback__))  # lines kept
    del x
    gc.collect()
    assert alive() is None
    assert info.value is not None  # the error is still held


_F64 = torch.float64
REFUSED_BY_EVERY_KERNEL = {
    "mm-dtypes": lambda d: torch.mm(
        torch.ones(2, 3, device=d), torch.ones(3, 2, dtype=_F64, device=d)
    ),
    "matmul-dtypes": lambda d: torch.ones(2, 3, device=d) @ torch.ones(3, 2, dtype=_F64, device=d),
    "linear-dtypes": lambda d: torch.nn.functional.linear(
        torch.ones(2, 3, device=d), torch.ones(2, 3, dtype=_F64, device=d)
    ),
    "addmm-dtypes": lambda d: torch.addmm(
        torch.ones(2, 2, device=d),
        torch.ones(2, 3, device=d),
        torch.ones(3, 2, dtype=_F64, device=d),
    ),
    "mv-dtypes": lambda d: torch.mv(
        torch.ones(2, 3, device=d), torch.ones(3, dtype=_F64, device=d)
    ),
    "conv-dtypes": lambda d: torch.nn.functional.conv2d(
        torch.ones(1, 1, 4, 4, device=d), torch.ones(1, 1, 3, 3, dtype=_F64, device=d)
    ),
    "index_select-float-index": lambda d: torch.ones(3, device=d).index_select(
        0, torch.zeros(1, device=d)
    ),
    "sort-dim": lambda d: torch.sort(torch.ones(3, device=d), dim=3),
    "std-of-int64": lambda d: torch.arange(5, device=d).std(),
    "softmax-of-int64": lambda d: torch.arange(3, device=d).softmax(0),
    "cross_entropy-of-int64": lambda d: torch.nn.functional.cross_entropy(
        torch.ones(2, 3, dtype=torch.long, device=d), torch.zeros(2, dtype=torch.long, device=d)
    ),
    "cross_entropy-int32-targets": lambda d: torch.nn.functional.cross_entropy(
        torch.ones(2, 3, device=d), torch.zeros(2, dtype=torch.int32, device=d)
    ),
    "nll_loss2d-int32-targets": lambda d: torch.nn.functional.nll_loss(
        torch.ones(2, 3, 4, 4, device=d), torch.zeros(2, 4, 4, dtype=torch.int32, device=d)
    ),
    "addmm-bias-dtype": lambda d: torch.addmm(
        torch.ones(2, dtype=_F64, device=d), torch.ones(2, 3, device=d), torch.ones(3, 2, device=d)
    ),
    "linear-bias-dtype": lambda d: torch.nn.functional.linear(
        torch.ones(4, 2, 3, device=d), torch.ones(2, 3, device=d), torch.ones(2, dtype=_F64, device=d)
    ),
    "linear-input-dtype-with-bias": lambda d: torch.nn.functional.linear(
        torch.ones(2, 3, dtype=_F64, device=d), torch.ones(2, 3, device=d), torch.ones(2, device=d)
    ),
    "layer_norm-weight-dtype": lambda d: torch.nn.functional.layer_norm(
        torch.ones(2, 4, device=d), (4,), torch.ones(4, dtype=_F64, device=d)
    ),
    "layer_norm-bias-dtype": lambda d: torch.nn.functional.layer_norm(
        torch.ones(2, 4, device=d), (4,), torch.ones(4, device=d), torch.ones(4, dtype=_F64, device=d)
    ),
    "layer_norm-float32-params-of-float64": lambda d: torch.nn.functional.layer_norm(
        torch.ones(2, 4, dtype=_F64, device=d), (4,), torch.ones(4, device=d)
    ),
    "group_norm-weight-dtype": lambda d: torch.nn.functional.group_norm(
        torch.ones(2, 4, 3, dtype=torch.bfloat16, device=d), 2, torch.ones(4, dtype=_F64, device=d)
    ),
    "cross_entropy-weight-dtype": lambda d: torch.nn.functional.cross_entropy(
        torch.ones(2, 3, device=d), torch.zeros(2, dtype=torch.long, device=d),
        weight=torch.ones(3, dtype=_F64, device=d),
    ),
    "binary_cross_entropy-target-dtype": lambda d: torch.nn.functional.binary_cross_entropy(
        torch.full((3,), 0.5, device=d), torch.ones(3, dtype=_F64, device=d)
    ),
    "softmax-dim": lambda d: torch.ones(2, 3, device=d).softmax(2),
    "log_softmax-dim": lambda d: torch.ones(2, 3, device=d).log_softmax(-3),
    "int-to-negative-power": lambda d: torch.arange(3, device=d) ** -1,
    "multinomial-too-many": lambda d: torch.ones(3, device=d).multinomial(4),
    "multinomial-none": lambda d: torch.ones(3, device=d).multinomial(0, replacement=True),
}  # fmt: skip
_IDX = (lambda d: torch.tensor([0], device=d), lambda d: torch.tensor([0.0], device=d))
WRITES_REFUSED = {  # (target) -> the in-place op on it
    "index_copy_-dtype": lambda x, d: x.index_copy_(0, _IDX[0](d), torch.ones(1, dtype=_F64, device=d)),
    "index_copy_-index": lambda x, d: x.index_copy_(0, _IDX[1](d), torch.ones(1, device=d)),
    "index_add_-dtype": lambda x, d: x.index_add_(0, _IDX[0](d), torch.ones(1, dtype=_F64, device=d)),
    "index_add_-index": lambda x, d: x.index_add_(0, _IDX[1](d), torch.ones(1, device=d)),
    "index_fill_-index": lambda x, d: x.index_fill_(0, _IDX[1](d), 1.0),
    "index_put_-dtype": lambda x, d: x.index_put_((_IDX[0](d),), torch.ones(1, dtype=_F64, device=d)),
    "setitem-dtype": lambda x, d: x.__setitem__(_IDX[0](d), torch.ones(1, dtype=_F64, device=d)),
    "put_-dtype": lambda x, d: x.put_(_IDX[0](d), torch.ones(1, dtype=_F64, device=d)),
}  # fmt: skip
REFUSED_BY_EVERY_KERNEL.update(
    {k: (lambda d, w=w: w(torch.arange(3.0, device=d), d)) for k, w in WRITES_REFUSED.items()}
)
SAME_MESSAGE = {*WRITES_REFUSED, "cross_entropy-int32-targets", "nll_loss2d-int32-targets", "mm-dtypes", "matmul-dtypes", "linear-dtypes", "index_select-float-index", "sort-dim",
                "std-of-int64", "addmm-dtypes", "addmm-bias-dtype", "linear-bias-dtype",
                "linear-input-dtype-with-bias", "layer_norm-weight-dtype", "layer_norm-bias-dtype",
                "layer_norm-float32-params-of-float64", "group_norm-weight-dtype",
                "cross_entropy-weight-dtype", "binary_cross_entropy-target-dtype", "softmax-dim",
                "log_softmax-dim", "int-to-negative-power", "multinomial-too-many",
                "multinomial-none"}  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSED_BY_EVERY_KERNEL))
def test_what_every_kernel_refuses_is_refused_at_the_op(dev, counted, case):
    """The meta kernels accept these: the op failed on the server, raised at a later wait with
    its outputs poisoned. Now at the op, as on the CPU, with nothing sent."""
    op = REFUSED_BY_EVERY_KERNEL[case]
    with pytest.raises(Exception) as cpu:
        op("cpu")
    with pytest.raises(type(cpu.value)) as remote:
        op(dev)
    if case in SAME_MESSAGE:
        assert str(remote.value) == str(cpu.value)
    assert counted()["waits"] == 0
    torch.rgpu.synchronize()  # nothing failed on the server


def test_the_variants_every_kernel_takes_still_run(dev):
    x = torch.arange(6, device=dev).reshape(2, 3)
    assert torch.equal(
        x.softmax(1, dtype=torch.float32).cpu(), x.cpu().softmax(1, dtype=torch.float32)
    )
    a = torch.randn(2, 3, dtype=torch.bfloat16)
    b = torch.randn(3, 2, dtype=torch.bfloat16)
    assert torch.equal((a.to(dev) @ b.to(dev)).cpu(), a @ b)
    assert torch.equal(torch.sort(x, dim=-2).values.cpu(), torch.sort(x.cpu(), dim=-2).values)
    assert torch.equal(x.index_select(1, torch.tensor([2, 0], dtype=torch.int32, device=dev)).cpu(),
                       x.cpu().index_select(1, torch.tensor([2, 0], dtype=torch.int32)))  # fmt: skip
    # normalization of a bfloat16 input by float32 parameters (mixed precision) runs
    h = torch.randn(2, 4, 3).to(torch.bfloat16)
    w, b = torch.randn(4), torch.randn(4)
    F = torch.nn.functional
    for run in (lambda h, w, b: F.group_norm(h, 2, w, b),
                lambda h, w, b: F.layer_norm(h.transpose(1, 2), (4,), w, b),
                lambda h, w, b: F.layer_norm(h.transpose(1, 2), (4,), None, b)):  # fmt: skip
        assert torch.equal(run(h.to(dev), w.to(dev), b.to(dev)).cpu(), run(h, w, b))
    assert torch.equal((x**2).cpu(), x.cpu() ** 2)
    assert torch.equal(x.float().softmax(-2).cpu(), x.cpu().float().softmax(-2))
    p = torch.tensor([0.2, 0.8])
    drawn = p.to(dev).multinomial(5, replacement=True).cpu()
    assert drawn.shape == (5,) and set(drawn.tolist()) <= {0, 1}
    # linear of a strided batch adds its bias in place: a float64 bias is taken
    h, w, bias = torch.randn(3, 2, 5).transpose(0, 1), torch.randn(4, 5), torch.randn(4, dtype=_F64)
    with torch.no_grad():
        assert torch.equal(F.linear(h.to(dev), w.to(dev), bias.to(dev)).cpu(), F.linear(h, w, bias))
    w.requires_grad_()
    remote_w = w.detach().to(dev).requires_grad_()
    out, remote = F.linear(h, w, bias), F.linear(h.to(dev), remote_w, bias.to(dev))
    assert remote.dtype == out.dtype == torch.float32
    out.sum().backward()
    remote.sum().backward()
    assert torch.equal(remote.cpu(), out.detach()) and torch.equal(remote_w.grad.cpu(), w.grad)
    # one CPU value of another dtype through a bool mask: index_put_ fills it (masked_fill_)
    for value in (torch.tensor(1.5, dtype=_F64), torch.tensor([2], dtype=torch.long)):
        y = torch.randn(3, 4)
        remote = y.to(dev)
        remote[remote > 0] = value
        y[y > 0] = value
        assert torch.equal(remote.cpu(), y)
    weight = torch.rand(3, dtype=_F64)  # binary_cross_entropy's weight may be of another dtype
    q, t = torch.rand(3), torch.rand(3)
    assert torch.equal(F.binary_cross_entropy(q.to(dev), t.to(dev), weight.to(dev)).cpu(),
                       F.binary_cross_entropy(q, t, weight))  # fmt: skip


@pytest.mark.parametrize("case", list(WRITES_REFUSED))
def test_an_in_place_write_every_kernel_refuses_leaves_its_tensor_as_it_was(dev, case):
    """Sent, it failed on the server and poisoned the tensor it would have written."""
    x = torch.arange(3.0, device=dev)
    with pytest.raises((RuntimeError, IndexError)):
        WRITES_REFUSED[case](x, dev)
    assert x.cpu().tolist() == [0.0, 1.0, 2.0]


OVERLAPPING_WRITES = {
    "index_add_-of-itself": lambda x, d: x.index_add_(0, torch.tensor([0, 1, 3], device=d), x[:3]),
    "shifted-add_": lambda x, d: x[1:].add_(x[:-1]),
    "out=-into-its-input": lambda x, d: torch.mul(x[1:], 2, out=x[:-1]),
}


@pytest.mark.parametrize("case", list(OVERLAPPING_WRITES))
def test_a_write_into_memory_its_input_reads_is_refused_at_the_op(dev, counted, case):
    """Every kernel refuses it before writing; sent like any op, the refusal came at a later
    wait and the tensor was poisoned. Now one wait, at the op, and the tensor is intact."""
    write = OVERLAPPING_WRITES[case]
    with pytest.raises(RuntimeError, match="unsupported operation: some elements") as cpu:
        write(torch.arange(12.0), "cpu")
    x = torch.arange(12.0, device=dev)
    with pytest.raises(RuntimeError) as remote:
        write(x, dev)
    assert str(cpu.value) in str(remote.value)
    assert counted()["waits"] == 1
    assert x.cpu().tolist() == torch.arange(12.0).tolist()


def test_writes_the_kernels_take_from_shared_memory_run_as_on_the_cpu(dev, counted):
    """Columns of one tensor (PyTorch cannot tell overlap there, and checks nothing), disjoint
    halves, a tensor and itself, a tensor and a view of all of it: computed as on the CPU, and
    only the last waits (another tensor over the same memory: the server's kernel decides)."""
    cases = [
        (lambda x: x.view(4, 3)[:, 2].sub_(x.view(4, 3)[:, 0]), 0),
        (lambda x: x.mul_(x), 0),
        (lambda x: x[:6].add_(x[6:]), 0),
        (lambda x: x.add_(x[:]), 1),
    ]
    for write, waits in cases:
        ref = torch.arange(12.0)
        write(ref)
        x = torch.arange(12.0, device=dev)
        before = counted()["waits"]
        write(x)
        assert counted()["waits"] - before == waits
        assert x.cpu().tolist() == ref.tolist()
