"""The routing-weight gradient of a weighted combine: per row, dot(y[row], rows of g[row]).

`combine(y, handle, weights=w)` is, per token, a sum of `w[row] * y[row]`; the cotangent of
`w[row]` is the dot product over H of `y[row]` and the row of the output's cotangent dispatched
along the same layout. On CPU the sum runs in one fixed order (below), which the host handlers
compute inside the fused combine VJP (xla_ffi/common/numeric.h, RowDotT), so the `ffi` and `xla`
backends agree bit for bit without materialising the cotangent's rows. On other platforms it is
XLA's own reduction, shared by every backend there.

The order: products rounded to float32; `L = lanes(H)` lane sums, lane l adding the products at
h = l, L + l, 2L + l, ... in ascending h, the `H % L` trailing products added to lanes
0 .. H % L - 1 last; then the lanes halved pairwise (lane l += lane l + w // 2 at width w, an odd
last lane moving down) until one is left.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def lanes(hidden: int) -> int:
    """L = min(H, 16 * ceil(H / 1024)): at most ~64 steps per lane, whole AVX-512 registers."""
    return min(hidden, 16 * -(-hidden // 1024))


def _halve(acc, concat):
    """Pairwise halving of the lanes (last axis) down to one."""
    width = acc.shape[-1]
    while width > 1:
        half = width // 2
        summed = acc[..., :half] + acc[..., half : 2 * half]
        acc = concat([summed, acc[..., 2 * half :]]) if width % 2 else summed
        width = half + width % 2
    return acc[..., 0]


def fixed_order_dot(y, g):
    """[C] float32: per row, the dot product of y and g [C, H] in the order above (XLA ops)."""
    c, hidden = y.shape
    if hidden == 0:  # an empty sum (and the same varying mesh axes as y)
        return jnp.sum(y.astype(jnp.float32) * g.astype(jnp.float32), axis=1)
    width = lanes(hidden)
    steps, tail = divmod(hidden, width)
    # The barrier keeps XLA from contracting the products into the adds (FMA); the host kernels
    # round each product first (-ffp-contract=off).
    p = jax.lax.optimization_barrier(y.astype(jnp.float32) * g.astype(jnp.float32))
    acc = p[:, :width]
    for i in range(1, steps):
        acc = acc + p[:, i * width : (i + 1) * width]
    if tail:
        acc = jnp.concatenate([acc[:, :tail] + p[:, steps * width :], acc[:, tail:]], axis=1)
    return _halve(acc, lambda parts: jnp.concatenate(parts, axis=-1))


def fixed_order_dot_numpy(y, g):
    """fixed_order_dot in numpy (float32 throughout), for tests."""
    p = np.asarray(y, np.float32) * np.asarray(g, np.float32)
    c, hidden = p.shape
    if hidden == 0:
        return np.zeros((c,), np.float32)
    width = lanes(hidden)
    steps, tail = divmod(hidden, width)
    acc = p[:, :width].copy()
    for i in range(1, steps):
        acc = acc + p[:, i * width : (i + 1) * width]
    acc[:, :tail] = acc[:, :tail] + p[:, steps * width :]
    return _halve(acc, lambda parts: np.concatenate(parts, axis=-1))


def row_dot(platform: str, y, rows):
    """[C] float32 routing-weight gradient from y and the cotangent's rows [C, H] (same dtype):
    the fixed order on CPU (what the host handlers compute), XLA's reduction elsewhere."""
    if platform == "cpu":
        return fixed_order_dot(y, rows)
    return jnp.sum(y.astype(jnp.float32) * rows.astype(jnp.float32), axis=1)
