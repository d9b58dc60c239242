"""The direct rules of rgpu.fast_meta give exactly what the slow path (PyTorch's meta kernels
with rgpu's layout fixes) gives, on layouts that exercise them; off their path they step aside."""

from __future__ import annotations

import itertools

import pytest
import torch

from rgpu import fast_meta, meta_fixes, tensor

aten = torch.ops.aten


def _layouts(shape: tuple) -> list[torch.Tensor]:
    """Meta tensors of `shape`: contiguous, transposed, sliced, expanded, with an offset."""
    out = [torch.empty(shape, device="meta")]
    n = len(shape)
    if n >= 2:
        t = torch.empty(shape[:-2] + (shape[-1], shape[-2]), device="meta").transpose(-1, -2)
        out.append(t)
    if n >= 1:
        wide = torch.empty(shape[:-1] + (shape[-1] * 2 + 1,), device="meta")
        out.append(wide[..., 1 : 1 + shape[-1]])  # strided rows, offset 1
        if shape[0] > 0:
            out.append(torch.empty((1,) + shape[1:], device="meta").expand(shape))
    if n == 4:
        out.append(torch.empty(shape, device="meta").contiguous(memory_format=torch.channels_last))
    return out


def _same(fast: torch.Tensor, slow: torch.Tensor) -> bool:
    return (fast.shape, fast.stride(), fast.dtype, fast.storage_offset()) == (
        slow.shape, slow.stride(), slow.dtype, slow.storage_offset())  # fmt: skip


SHAPES = [(), (5,), (3, 4), (1, 4), (2, 1, 3), (1, 4, 1, 8), (2, 3, 4, 5), (2, 1, 1, 3)]


@pytest.mark.parametrize("op", [aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_arithmetic_matches_the_slow_path(op, device):
    checked = 0
    for sa, sb in itertools.product(SHAPES, SHAPES):
        for a, b in itertools.product(_layouts(sa), _layouts(sb)):
            try:
                slow = meta_fixes.run_meta(op, (a, b), {}, device)
            except RuntimeError:
                assert fast_meta.run(op, (a, b), {}) is None  # shapes that do not broadcast
                continue
            fast = fast_meta.run(op, (a, b), {})
            assert fast is not None and _same(fast, slow), (sa, a.stride(), sb, b.stride())
            checked += 1
    assert checked > 200


@pytest.mark.parametrize("dim", [0, 1, -1, -2])
def test_cat_matches_the_slow_path(dim):
    checked = 0
    for base in [(2, 3, 4, 5), (1, 4, 6, 8), (3, 4), (2, 3, 4)]:
        grown = list(base)
        grown[dim] += 2
        for a, b in itertools.product(_layouts(base), _layouts(tuple(grown))):
            slow = meta_fixes.run_meta(aten.cat.default, ([a, b], dim), {}, "cpu")
            fast = fast_meta.run(aten.cat.default, ([a, b], dim), {})
            if fast is None:  # every input channels-last: the slow path decides
                assert all(t.dim() == 4 for t in (a, b))
                continue
            assert _same(fast, slow), (base, a.stride(), b.stride(), dim)
            checked += 1
    assert checked >= 16


def test_off_the_plain_path_the_slow_path_decides():
    a = torch.empty(3, 4, device="meta")
    assert fast_meta.run(aten.add.Tensor, (a, a.double()), {}) is None  # promotion
    assert fast_meta.run(aten.add.Tensor, (a, a), {"alpha": 2}) is None
    assert fast_meta.run(aten.add.Tensor, (a, torch.empty(3, 4)), {}) is None  # a CPU tensor
    assert fast_meta.run(aten.mul.Tensor, (a, torch.empty(5, device="meta")), {}) is None
    assert fast_meta.run(aten.cat.default, ([a, torch.empty(0, device="meta")],), {}) is None
    assert fast_meta.run(aten.cat.default, ([a, a.int()], 0), {}) is None
    b = a.bool()
    assert fast_meta.run(aten.sub.Tensor, (b, b), {}) is None  # the op's own error, slowly


def _wrapper_layout(w: torch.Tensor) -> tuple:
    return (w.dtype, tuple(w.shape), w.stride(), w.storage_offset(),
            w.untyped_storage().nbytes(), w.is_contiguous(), w.is_conj())  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool, torch.complex64, torch.int64])
def test_dense_wrappers_have_the_layout_of_the_general_ones(dtype):
    """`wrap_dense` leaves strides, offset and storage size to PyTorch: for every key that
    `is_dense_key` accepts they must come out as the key says; every other key is refused."""
    from rgpu.session import Session  # a stand-in session: wrappers only note their frees

    sess = Session.__new__(Session)
    sess.frees, sess.free_bytes = __import__("collections").deque(), 0
    dense = refused = 0
    for shape in [(), (0,), (3, 0, 2), (5,), (1,), (4, 1, 3), (1, 1), (2, 3, 4, 5)]:
        base = torch.empty(shape, dtype=dtype, device="meta")
        candidates = [base]
        if base.dim() >= 2:
            candidates.append(base.transpose(0, -1))
        if base.numel() > 1:
            candidates += [base.view(-1)[1:], base.view(-1)[: base.numel() - 1]]
        if base.dim() == 4:
            candidates.append(base.contiguous(memory_format=torch.channels_last))
        if dtype.is_complex:
            candidates.append(base.conj())
        for m in candidates:
            key = tensor.key_of_meta(m)
            general = tensor.wrap(sess, key)
            assert _wrapper_layout(general)[:5] == key[:5]
            if tensor.is_dense_key(key):
                dense += 1
                assert _wrapper_layout(tensor.wrap_dense(sess, key)) == _wrapper_layout(general)
            else:
                refused += 1  # its layout is not that of a fresh tensor of its shape
                fresh = torch.empty(m.shape, dtype=dtype, device="meta")
                assert tensor.key_of_meta(fresh) != key
    assert dense >= 8 and refused >= 8
