"""The direct rules of rgpu.fast_meta give exactly what the slow path (PyTorch's meta kernels
with rgpu's layout fixes) gives, on layouts that exercise them; off their path they step aside."""

from __future__ import annotations

import itertools

import pytest
import torch

from rgpu import fast_meta, meta_fixes

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
