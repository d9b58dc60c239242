"""c10's and TensorIterator's layout rules, on shapes and strides alone.

Why: predicting an op's output layout on the client (rgpu/meta_fixes.py, rgpu/fast_meta.py)
needs the exact strides the real kernels would pick, and these rules are the ones they follow:
`empty_like`'s (keep a dense input's strides, else infer dense ones) and TensorIterator's (the
permutation of the operands' strides, with its tie breaks).
"""

from __future__ import annotations


def empty_like_strides(shape: tuple, stride: tuple) -> tuple:
    """The strides empty_like / .to() give: the input's own when c10 counts it dense (contiguous,
    channels-last or non-overlapping and dense), else c10's infer_dense_strides."""
    if _contiguous(shape, stride) or _channels_last(shape, stride):
        return tuple(stride)
    if _non_overlapping_and_dense(shape, stride):
        return tuple(stride)
    ndim = len(shape)
    perm = list(range(ndim - 1, -1, -1))

    def should_swap(d0: int, d1: int) -> int:
        s0, s1 = stride[d0], stride[d1]
        if s0 == 0 or s1 == 0:
            return 0
        if s0 != s1:
            return -1 if s0 < s1 else 1
        return 1 if shape[d0] > shape[d1] else 0

    _insertion_sort(perm, should_swap)
    out = [0] * ndim
    step = 1
    for d in perm:
        out[d] = step
        if shape[d] > 1:
            step *= shape[d]
    return tuple(out)


def _insertion_sort(perm: list[int], should_swap) -> None:
    """TensorIterator's sort of dims, fastest first, that leaves ambiguous pairs in place."""
    for i in range(1, len(perm)):
        dim1 = i
        for dim0 in range(i - 1, -1, -1):
            c = should_swap(perm[dim0], perm[dim1])
            if c > 0:
                perm[dim0], perm[dim1] = perm[dim1], perm[dim0]
                dim1 = dim0
            elif c < 0:
                break


def _contiguous(shape: tuple, stride: tuple) -> bool:
    """c10's is_contiguous: size-1 dims may have any stride, an empty tensor is contiguous."""
    if 0 in shape:
        return True
    expected = 1
    for d in range(len(shape) - 1, -1, -1):
        if shape[d] != 1:
            if stride[d] != expected:
                return False
            expected *= shape[d]
    return True


def _channels_last(shape: tuple, stride: tuple) -> bool:
    """c10's is_contiguous(memory_format=torch.channels_last) (no shortcut for empty tensors)."""
    if len(shape) != 4:
        return False
    expected = 1
    for d in (1, 3, 2, 0):
        if shape[d] != 1:
            if stride[d] != expected:
                return False
            expected *= shape[d]
    return True


def _non_overlapping_and_dense(shape: tuple, stride: tuple) -> bool:
    """c10's compute_non_overlapping_and_dense."""
    if len(shape) == 1:
        return shape[0] < 2 or stride[0] == 1
    expected = 1
    for d in sorted(range(len(shape)), key=lambda d: (shape[d] < 2, stride[d])):
        if shape[d] < 2:
            return True
        if stride[d] != expected:
            return False
        expected *= shape[d]
    return True


def row_major(shape: tuple) -> tuple:
    """c10's contiguous strides (a size-0 dim counts as 1)."""
    strides = [0] * len(shape)
    step = 1
    for d in range(len(shape) - 1, -1, -1):
        strides[d] = step
        step *= max(shape[d], 1)
    return tuple(strides)


def tensor_iterator_strides(inputs: list[tuple[tuple, tuple]], shape: tuple) -> tuple | None:
    """The strides TensorIterator gives a fresh output of `shape` for inputs given as (shape,
    stride) pairs, in argument order (aten/src/ATen/TensorIterator.cpp: compute_fast_setup_type,
    compute_strides, reorder_dimensions, allocate_or_resize_outputs). None: inputs that do not
    broadcast to `shape`."""
    ndim = len(shape)
    if ndim == 0:
        return ()
    if all(s == shape for s, _ in inputs):  # the fast set-ups
        if all(_contiguous(s, st) for s, st in inputs):
            return row_major(shape)
        if all(_channels_last(s, st) for s, st in inputs):
            n, c, h, w = shape  # c10's get_channels_last_strides_2d (no max(size, 1))
            return (h * w * c, 1, w * c, c)
        if all(_non_overlapping_and_dense(s, st) for s, st in inputs):
            if all(st == inputs[0][1] for _, st in inputs):
                return tuple(inputs[0][1])
    strides = []  # each input's strides over the output's dims; 0 where it is broadcast
    for s, st in inputs:
        offset = ndim - len(s)
        if offset < 0:
            return None
        full = [0] * ndim
        for i, (size, step) in enumerate(zip(s, st)):
            if size != shape[offset + i] and size != 1:
                return None
            full[offset + i] = 0 if size == 1 and shape[offset + i] != 1 else step
        strides.append(full)

    def should_swap(dim0: int, dim1: int) -> int:
        for full in strides:
            s0, s1 = full[dim0], full[dim1]
            if s0 == 0 or s1 == 0:
                continue
            if s0 < s1:
                return -1
            if s0 > s1:
                return 1
            if shape[dim0] > shape[dim1]:
                return 1
        return 0

    perm = list(range(ndim - 1, -1, -1))  # perm[0] is the fastest-moving dim
    _insertion_sort(perm, should_swap)
    if perm == list(range(ndim - 1, -1, -1)):
        return row_major(shape)
    out = [0] * ndim
    step = 1
    for d in perm:  # TensorIterator's compatible_stride: no max(size, 1) here
        out[d] = step
        step *= shape[d]
    return tuple(out)
