"""DEFINE and REPLAY without a client: the wire forms, and the server running a replayed
sequence exactly as it runs the same ops sent one RUN at a time.

The equivalence tests feed one server session the RUNs and another the DEFINE and REPLAY of the
same ops (through `Session._run_frame`, as frames from a connection would go), then compare the
two sessions' tensor tables id by id: values, layouts and poisons (label, message, and the op a
replayed poison names), and the error the next wait would report.
"""

from __future__ import annotations

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from rgpu_server.poison import Poison
from rgpu_server.quota import Quota
from rgpu_server.session import Session

import rgpu_protocol as p
from rgpu.sequences import OpRec, merge, scalar_items

ENCODE = p.Encoder().encode


class T:  # a tensor by id, in the programs below
    def __init__(self, tid, view=None):
        self.tid, self.view = tid, view


class F:  # a float that changes between repetitions: a PARAM of the sequence
    def __init__(self, value):
        self.value = value


def forms(program, base):
    """(the RUNs, the DEFINE's ops, the run's inputs, its params) of a program: ops
    [name, args, kwargs, out ids] with T and F leaves. Ids from `base` on are the run's own."""
    inputs: list[int] = []

    def plain(v):
        if isinstance(v, T):
            return p.Ref(v.tid) if v.view is None else p.ViewRef(v.tid, *v.view)
        if isinstance(v, F):
            return v.value
        if isinstance(v, list):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    def slotted(v, params):
        if isinstance(v, T):
            if v.tid >= base:
                kind, index = p.SlotKind.OUT, v.tid - base
            else:
                if v.tid not in inputs:
                    inputs.append(v.tid)
                kind, index = p.SlotKind.INPUT, inputs.index(v.tid)
            return p.Slot(kind, index) if v.view is None else p.SlotView(kind, index, *v.view)
        if isinstance(v, F):
            params.append(v.value)
            return p.Slot(p.SlotKind.PARAM, len(params) - 1)
        if isinstance(v, list):
            return [slotted(x, params) for x in v]
        if isinstance(v, dict):
            return {k: slotted(x, params) for k, x in v.items()}
        return v

    runs, ops, all_params = [], [], []
    for name, args, kwargs, outs, *expect in program:
        runs.append([p.Kind.RUN, name, plain(args), plain(kwargs), outs, *expect])
        params: list = []
        ops.append([name, slotted(args, params), slotted(kwargs, params),
                    [None if o is None else o - base for o in outs], expect[0] if expect else None])  # fmt: skip
        all_params += params
    return runs, ops, inputs, all_params


def server_session(tensors, quota=None):
    s = Session(b"\x01" * 16, torch.device("cpu"), p.Limits(), quota=quota)
    s.tensors.update({k: v.clone() for k, v in tensors.items()})
    if quota is not None:
        s.quota = Quota(quota)
        s.quota.charge(s.tensors, list(s.tensors))
    return s


def run_both(program, tensors, base=100, parts=None, cancel_from=None, quota=None):
    """The two sessions after the program ran as RUNs and as one DEFINE and REPLAY(s)."""
    runs, ops, inputs, params = forms(program, base)
    plain = server_session(tensors, quota)
    if cancel_from is not None:
        plain.stream.cancel(cancel_from + len(runs))
    plain._run_frame(p.batch_frame(1, [ENCODE(m) for m in runs]), 0)
    replayed = server_session(tensors, quota)
    messages = [ENCODE([p.Kind.DEFINE, 3, ops])]
    start = 0
    seqs = []  # (first op, seq) of each REPLAY
    for stop in parts or [len(ops)]:
        run_inputs = inputs[
            len(_input_ids(program[:start], base)) : len(_input_ids(program[:stop], base))
        ]
        before, upto = _count_params(program[:start]), _count_params(program[:stop])
        messages.append(
            ENCODE([p.Kind.REPLAY, 3, start, stop, base, run_inputs, params[before:upto]])
        )
        seqs.append((start, 1 + len(messages) - 1))
        start = stop
    if cancel_from is not None:
        replayed.stream.cancel(cancel_from + len(messages))
    replayed._run_frame(p.batch_frame(1, messages), 0)
    return plain, replayed, seqs


def _input_ids(program, base):
    seen: list[int] = []

    def walk(v):
        if isinstance(v, T) and v.tid < base and v.tid not in seen:
            seen.append(v.tid)
        elif isinstance(v, list):
            for x in v:
                walk(x)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)

    for _, args, kwargs, *_ in program:
        walk(args)
        walk(kwargs)
    return seen


def _count_params(program):
    def count(v):
        if isinstance(v, F):
            return 1
        if isinstance(v, list):
            return sum(count(x) for x in v)
        if isinstance(v, dict):
            return sum(count(x) for x in v.values())
        return 0

    return sum(count(args) + count(kwargs) for _, args, kwargs, *_ in program)


def assert_same(plain, replayed, seqs):
    """Same ids, same values and layouts, same poisons; a replayed poison names the op whose
    RUN the plain session numbered (RUN seq = op index + 1)."""
    try:
        _compare(plain, replayed, seqs)
    finally:
        plain.stop()  # its worker clears the table as it ends
        replayed.stop()


def _compare(plain, replayed, seqs):
    assert plain.tensors.keys() == replayed.tensors.keys()
    for tid, a in plain.tensors.items():
        b = replayed.tensors[tid]
        assert type(a) is type(b), tid
        if isinstance(a, torch.Tensor):
            assert a.shape == b.shape and a.stride() == b.stride(), tid
            assert a.storage_offset() == b.storage_offset(), tid
            assert torch.equal(a, b), tid
        else:
            assert (a.label, a.message) == (b.label, b.message), tid
            if b.index is not None:  # failed inside the replay: the op the RUN numbered
                start = max(s for s, q in seqs if q == b.seq)
                assert a.seq == start + b.index + 1, tid
    fa, fb = plain.first_error, replayed.first_error
    assert (fa is None) == (fb is None)
    if fa is not None:
        assert fa[:2] == fb[:2]
        if len(fb) > 3:
            start = max(s for s, q in seqs if q == fb[2])
            assert fa[2] == start + fb[3] + 1
    assert plain.ops_run == replayed.ops_run


def host(t):
    return p.HostData(t.dtype, tuple(t.shape), t.numpy().tobytes())


X = {
    1: torch.arange(12.0).reshape(3, 4),
    2: torch.ones(4),
    3: torch.tensor([0, 2, 1]),
    4: torch.ones(2),
}


def test_a_replayed_sequence_computes_what_its_runs_compute():
    program = [
        ["add.Tensor", [T(1), T(2)], None, [100]],
        ["mul.Scalar", [T(100), F(0.5)], None, [101]],
        ["add_.Tensor", [T(101), T(2)], {"alpha": F(2.0)}, [None]],
        ["max.dim", [T(101), 1], None, [102, 103]],
        ["index_select.default", [T(1, ((2, 2), (4, 1), 1)), 1, T(3)], None, [104]],
        ["_foreach_add.Scalar", [[T(100), T(102), T(2)], F(1.5)], None, [105, 106, 107]],
        ["_foreach_mul_.ScalarList", [[T(105), T(106)], [F(2.0), F(3.0)]], None, []],
        ["mul.Tensor", [T(107), host(torch.tensor([2.0, 3.0, 4.0, 5.0]))], None, [108]],
        ["sum.dim_IntList", [T(101, ((4,), (1,), 4)), [0]], {"keepdim": True}, [109]],
        ["clone.default", [T(104)], {"memory_format": torch.contiguous_format}, [110]],
        ["mul.Tensor", [T(110), F(host(torch.tensor(0.5, dtype=torch.float64)))], None, [111]],
    ]
    assert_same(*run_both(program, X))
    assert_same(*run_both(program, X, parts=[3, 7, len(program)]))  # in three REPLAYs


def test_a_view_named_twice_in_one_op_is_one_tensor_run_and_replayed():
    """As on the client, where it is one tensor: attention's fused kernel takes its
    self-attention path only when query, key and value are the same tensor (its results differ
    in the last bits from the cross-attention path's)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 6, 8, generator=g)
    w, b = torch.randn(24, 8, generator=g), torch.randn(24, generator=g)
    ow, ob = torch.randn(8, 8, generator=g), torch.randn(8, generator=g)
    view = ((3, 4, 8), (48, 8, 1), 0)
    q = T(1, view)
    program = [["_native_multi_head_attention.default",
                [q, q, q, 8, 2, T(2), T(3), T(4), T(5), None, False], None, [100, 101]]]  # fmt: skip
    tensors = {1: x, 2: w, 3: b, 4: ow, 5: ob}
    plain, replayed, seqs = run_both(program, tensors)
    try:
        xv = x[:, :4]
        want = torch._native_multi_head_attention(xv, xv, xv, 8, 2, w, b, ow, ob, None, False)[0]
        assert torch.equal(plain.tensors[100], want)
        assert torch.equal(replayed.tensors[100], want)
    finally:
        assert_same(plain, replayed, seqs)


def test_failures_inside_a_replay_poison_what_their_runs_would():
    program = [
        ["index_select.default", [T(1), 0, T(3)], None, [100]],
        ["add.Tensor", [T(100), 1], None, [101]],
        ["index_select.default", [T(1), 0, T(101)], None, [102]],  # out of range: raises
        ["mul.Tensor", [T(102), 2], None, [103]],  # a poisoned input passes it on
        ["add_.Tensor", [T(2), T(103)], None, [None]],  # an in-place op on poison: poisons 2
        ["add.Tensor", [T(99), 1], None, [104]],  # an id that was never made
        ["mul.Tensor", [T(1, ((3, 4), (4, 1), 50)), 2], None, [105]],  # a view out of bounds
        ["_print.default", ["no"], None, []],  # a refused operator
        ["add_.Tensor", [T(4), T(1)], None, [None]],  # raises (broadcast): poisons 4
        ["mul.Tensor", [T(4), 3], None, [106]],
        ["max.dim", [T(1), 1], None, [107]],  # one output id for two values
        ["add.Tensor", [T(1), 1], None, [108], [p.TensorMeta(torch.float32, (3, 4), (1, 3), 0)]],
    ]
    plain, replayed, seqs = run_both(program, X)
    assert isinstance(replayed.tensors[102], Poison) and replayed.tensors[102].index == 2
    assert replayed.tensors[103] is replayed.tensors[102]  # the same poison, passed on
    assert isinstance(replayed.tensors[4], Poison)  # a failed in-place op poisons what it writes
    assert_same(plain, replayed, seqs)
    assert_same(*run_both(program, X, parts=[2, 5, 9, len(program)]))


def test_seeded_ops_and_a_quota_take_the_runs_own_paths():
    program = [
        ["rand_like.default", [T(1)], None, [100]],
        ["native_dropout.default", [T(100), F(0.5), True], None, [101, 102]],
        ["randn.default", [[64, 64]], {"device": p.Device("rgpu")}, [103]],  # over the quota
        ["add.Tensor", [T(101), T(1)], None, [104]],
    ]
    assert_same(*run_both(program, X))
    assert_same(*run_both(program, X, quota=4096))


def test_an_interrupt_cancels_the_ops_of_a_replay_that_had_not_started():
    program = [
        ["add.Tensor", [T(1), 1], None, [100]],
        ["add_.Tensor", [T(2), 1], None, [None]],
        ["mul.Tensor", [T(100), 2], None, [101]],
    ]
    plain, replayed, seqs = run_both(program, X, cancel_from=0)
    assert replayed.tensors[101].message.startswith("cancelled: ")
    # what it would have written in place keeps its value: that op never happened
    assert torch.equal(replayed.tensors[2], X[2]) and torch.equal(plain.tensors[2], X[2])
    assert_same(plain, replayed, seqs)


def test_define_and_replay_refuse_what_they_cannot_run():
    define = [p.Kind.DEFINE, 0, [["add.Tensor", [p.Slot(p.SlotKind.INPUT, 0), 1], None, [0], None]]]
    cases = [
        ([p.Kind.DEFINE, p.MAX_SEQUENCES, define[2]], "slot must be"),
        ([p.Kind.DEFINE, 0, []], "holds 1 to"),
        ([p.Kind.DEFINE, 0, [["add.Tensor", [p.Ref(1), 1], None, [0], None]]], "by slot"),
        ([p.Kind.DEFINE, 0, [["x.y", [[[p.Slot(0, 0)]]], None, [0], None]]], "two deep"),
        ([p.Kind.DEFINE, 0, [["x.y", [p.Slot(2, 1)], None, [0], None]]], "PARAM slots"),
        ([p.Kind.REPLAY, 5, 0, 1, 100, [1], []], "holds no sequence"),
        ([p.Kind.REPLAY, 0, 0, 2, 100, [1], []], "of a 1-op sequence"),
        ([p.Kind.REPLAY, 0, 0, 1, 100, [], []], "needs 1 inputs"),
        ([p.Kind.REPLAY, 0, 0, 1, 100, [1], [2.0]], "wrong number of params"),
        ([p.Kind.REPLAY, 0, 0, 1, 100, [1.5], []], "must be tensor ids"),
    ]
    for msg, says in cases:  # each ends its session, as a protocol error does
        s = server_session(X)
        frames = [ENCODE(define)] if msg[0] == p.Kind.REPLAY else []
        with pytest.raises(p.ProtocolError, match=says):
            s._run_frame(p.batch_frame(1, [*frames, ENCODE(msg)]), 0)
        s.stop()


def test_a_replay_must_continue_the_run_it_names():
    s = server_session(X)
    two = [["add.Tensor", [p.Slot(p.SlotKind.INPUT, 0), 1], None, [0], None],
           ["add.Tensor", [p.Slot(p.SlotKind.OUT, 0), 1], None, [1], None]]  # fmt: skip
    frame = p.batch_frame(1, [ENCODE([p.Kind.DEFINE, 0, two]),
                              ENCODE([p.Kind.REPLAY, 0, 1, 2, 100, [], []])])  # fmt: skip
    with pytest.raises(p.ProtocolError, match="continues no run"):
        s._run_frame(frame, 0)
    s.stop()


def test_slot_values_roundtrip_and_hostile_payloads_are_refused():
    values = [p.Slot(p.SlotKind.OUT, 7), p.SlotView(p.SlotKind.INPUT, 2, (2, 3), (3, 1), 4)]
    assert p.unpack_one(ENCODE(values)) == values
    for code, data in [(11, b"\x00"), (11, b"\x09\x00\x00\x00\x00"), (12, b"\x02" + bytes(4)),
                       (12, b"\x00" + bytes(4) + b"\x01"), (11, bytes(6))]:  # fmt: skip
        with pytest.raises(p.ProtocolError):
            p.unpack_one(msgpack.packb(msgpack.ExtType(code, data)))


def test_the_new_kinds_are_checked_against_their_specs():
    assert p.check_message([p.Kind.DEFINE, 0, []]).kind == p.Kind.DEFINE
    assert p.check_message([p.Kind.REPLAY, 0, 0, 1, 5, [], []]).kind == p.Kind.REPLAY
    with pytest.raises(p.ProtocolError, match="REPLAY takes"):
        p.check_message([p.Kind.REPLAY, 0, 0, 1, 5, []])
    with pytest.raises(p.ProtocolError, match="DEFINE's ops must be list"):
        p.check_message([p.Kind.DEFINE, 0, "ops"])
    assert p.Kind.REPLAY in p.messages.CANCELLABLE and p.Kind.DEFINE not in p.WAITED


plain_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=40)
    | st.binary(max_size=300),
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(st.text(max_size=5), children, max_size=4),
    max_leaves=20,
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(plain_values, st.lists(st.floats(width=32) | st.integers(-5, 5), max_size=4))
def test_the_walker_finds_every_float_and_scalar_tensor_of_a_message(value, scalars):
    encode = p.Encoder().encode
    hosts = [p.HostData(torch.float32 if type(v) is float else torch.int64, (),
                        torch.tensor(v).numpy().tobytes()) for v in scalars]  # fmt: skip
    hosts.append(p.HostData(torch.float32, (2,), bytes(8)))  # not 0-dim: structure
    data = encode([value, hosts])
    items = scalar_items(data)

    def count(v):
        if isinstance(v, float):
            return 1
        if isinstance(v, list):
            return sum(count(x) for x in v)
        if isinstance(v, dict):
            return sum(count(x) for x in v.values())
        return 0

    assert len(items) == count(value) + len(scalars)
    floats = [i for i in items if data[i[0]] == 0xCB]
    assert all(end - begin == 8 for _, begin, end in floats)
    tensors = items[len(floats) :]
    for (_, begin, end), h in zip(tensors, hosts):
        assert data[begin:end] == h.data


def test_two_recordings_merge_into_a_template_whose_floats_vary():
    def rec(lr, step):
        return [OpRec(msgpack.packb(["mul.Scalar", [1, lr], None]), (0,), 1),
                OpRec(msgpack.packb(["add.Tensor", [2, step], None]), (1,), 1)]  # fmt: skip

    merged = merge(rec(0.1, 2), rec(0.2, 2))
    assert [len(op.mask) for op in merged] == [1, 0]
    lr = p.HostData(torch.float64, (), torch.tensor(0.5, dtype=torch.float64).numpy().tobytes())
    host = OpRec(p.Encoder().encode(["mul.Tensor", [1, lr], None]), (0,), 1)
    lr2 = p.HostData(torch.float64, (), torch.tensor(0.25, dtype=torch.float64).numpy().tobytes())
    host2 = OpRec(p.Encoder().encode(["mul.Tensor", [1, lr2], None]), (0,), 1)
    (op,) = merge([host], [host2])
    assert op.params(host.rel) == [msgpack.ExtType(6, p.host_ext(torch.float64, (), lr.data).data)]
    assert merged[0].same(rec(0.3, 2)[0].rel) and merged[0].params(rec(0.3, 2)[0].rel) == [0.3]
    assert merge(rec(0.1, 2), rec(0.1, 3)) is None  # ints are structure, never parameters
    assert merge(rec(0.1, 2), rec(0.1, 2)[:1]) is None
