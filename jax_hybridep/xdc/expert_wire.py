"""What one expert costs on the wire, whole or SR-compressed (numpy).

Shared by the runtime (`runtime.migrate`, which sends it, and `ExpertDomains.gather_bytes`) and
the byte model (`model.volumes`, which counts it), so both follow one rule: a matrix of n entries
compressed by `compression` (full bytes / bytes sent) travels as its top
`k = max(1, floor(n vb / (compression (vb + 4))))` residual entries, k values of `vb` bytes and k
int32 indices.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from jax_hybridep.values import check_int, check_ints, is_real

INDEX_BYTES = 4  # compressed experts carry int32 indices


def compressed(compression: float | None) -> bool:
    """Whether an SR compression setting compresses: None or <= 1 sends experts as they are.

    Raises ValueError for a value that is not a positive number."""
    if compression is None:
        return False
    if isinstance(compression, bool) or not isinstance(compression, int | float | np.number):
        raise ValueError(f"compression must be None or a number > 0, got {compression!r}")
    if not compression > 0 or not math.isfinite(compression):
        raise ValueError(f"compression must be None or a finite number > 0, got {compression!r}")
    return compression > 1


def topk_count(elements: int, compression: float, value_bytes: int) -> int:
    """Values kept of an `elements`-element matrix SR-compressed by `compression` (full bytes /
    bytes sent) in value-index form."""
    return max(1, math.floor(elements * value_bytes / (compression * (value_bytes + INDEX_BYTES))))


def _sizes(matrices: Sequence) -> list[int]:
    """Element count of each matrix, given as a count or a shape (ints >= 0, never truncated)."""
    if isinstance(matrices, str) or not isinstance(matrices, Sequence | np.ndarray):
        raise TypeError(f"expert_matrices must be a sequence of counts or shapes, got {matrices!r}")
    return [
        check_int("expert_matrices[i]", m, 0)
        if is_real(m)
        else math.prod(check_ints("expert_matrices[i]", m, 0))
        for m in matrices
    ]


def expert_wire_bytes(matrices: Sequence, compression: float | None, value_bytes: int) -> int:
    """Bytes one expert takes on the wire: `P1`, or the sum of `k * (vb + ib)` when compressed.

    Args:
      matrices: per matrix, its element count or its shape.
      compression: SR compression; None or <= 1 sends the matrices as they are.
      value_bytes: bytes per parameter value.
    """
    sizes = _sizes(matrices)
    if not compressed(compression):
        return sum(sizes) * value_bytes
    return sum(topk_count(n, compression, value_bytes) * (value_bytes + INDEX_BYTES) for n in sizes)


def expert_bytes_on_wire(expert_bytes, expert_matrices, compression, value_bytes) -> tuple:
    """(P1, bytes one expert takes on the wire, bytes of each matrix, compressed?) from one of
    `expert_bytes` (P1, one matrix) and `expert_matrices` (element counts or shapes)."""
    if (expert_bytes is None) == (expert_matrices is None):
        raise ValueError("give exactly one of expert_bytes and expert_matrices")
    check_int("value_bytes", value_bytes, 1)
    if expert_matrices is None:
        check_int("expert_bytes", expert_bytes, 0)
        if expert_bytes < 0 or expert_bytes % value_bytes:
            raise ValueError(f"expert_bytes={expert_bytes} is not a multiple of {value_bytes=}")
        # One matrix: compressed bytes are then approximate (the runtime rounds k per matrix).
        expert_matrices = [expert_bytes // value_bytes]
    if any(n < 0 for n in _sizes(expert_matrices)):
        raise ValueError(f"expert_matrices must have no negative sizes, got {expert_matrices}")
    return (
        expert_wire_bytes(expert_matrices, None, value_bytes),
        expert_wire_bytes(expert_matrices, compression, value_bytes),
        [n * value_bytes for n in _sizes(expert_matrices)],
        compressed(compression),
    )


def kept_entries(num_entries: int, dtype, compression: float | None) -> int:
    """k: entries of one matrix sent at compression `compression` (all of them when None)."""
    check_int("num_entries", num_entries, 0)
    compressed(compression)  # ValueError unless None or a finite number > 0
    if compression is None:
        return num_entries
    return topk_count(num_entries, compression, np.dtype(dtype).itemsize)


def sent_bytes(matrix_shape, dtype, compression: float | None) -> int:
    """Bytes one expert matrix of `matrix_shape` costs on the wire."""
    check_ints("matrix_shape", matrix_shape, 0, min_len=0)
    n, value_bytes = math.prod(matrix_shape), np.dtype(dtype).itemsize
    if compression is None:
        return n * value_bytes
    return kept_entries(n, dtype, compression) * (value_bytes + INDEX_BYTES)
