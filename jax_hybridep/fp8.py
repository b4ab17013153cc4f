"""FP8 on the wire (docs/design.md §2.1.8): each token quantised once at the source to float8_e4m3fn
with one float32 scale per block of 128 elements of H (the last block shorter), dequantised at
the receiver. The jnp formula here is the oracle; xla_ffi/fp8.h computes the same bits.

Per token and block, in float32 without fused multiply-add:
  amax = max(max |x_i| over the finite x_i of the block, 1e-4)
  scale = amax * (1 / 448);  inv = 448 / amax
  q_i = e4m3fn(clamp(x_i * inv, -448, 448))     (round to nearest even; NaN stays NaN)
  x_i' = float32(q_i) * scale, rounded once to x's dtype.

Wire rows (the host handlers' and the traffic count's unit): H payload bytes, then the block
scales, `wire_bytes(H) = H + 4 * ceil(H / 128)` bytes per token copy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

WIRE_DTYPES = ("float8_e4m3fn",)
BLOCK = 128
MAX = np.float32(448.0)
MIN_AMAX = np.float32(1e-4)
INV_MAX = np.float32(1.0) / MAX  # 1 / 448 rounded to float32, as the C++ constant expression


def num_blocks(hidden: int) -> int:
    return -(-hidden // BLOCK)


def wire_bytes(hidden: int) -> int:
    """Bytes one token copy carries: payload plus its block scales."""
    return hidden + 4 * num_blocks(hidden)


def _per_element(blocks, hidden: int):
    """[T, num_blocks] -> [T, H]: each element's block value."""
    return jnp.repeat(blocks, BLOCK, axis=1)[:, :hidden]


def quantize(x):
    """x [T, H] float -> (q [T, H] float8_e4m3fn, scales [T, ceil(H / 128)] float32)."""
    tokens, hidden = x.shape
    nb = num_blocks(hidden)
    x32 = x.astype(jnp.float32)
    finite = jnp.where(jnp.isfinite(x32), jnp.abs(x32), 0.0)
    padded = jnp.pad(finite, ((0, 0), (0, nb * BLOCK - hidden)))
    amax = jnp.maximum(jnp.max(padded.reshape(tokens, nb, BLOCK), axis=-1), MIN_AMAX)
    scales = amax * INV_MAX
    inv = MAX / amax
    return cast(x32, _per_element(inv, hidden)), scales


def cast(x32, inv):
    """The element step: e4m3fn(clamp(x32 * inv, -448, 448)), float32 x32 and inv."""
    # The barrier keeps XLA from fusing the multiply into the convert differently from the
    # C++ kernels, which round x * inv to float32 first.
    scaled = jax.lax.optimization_barrier(x32 * inv)
    return jnp.clip(scaled, -MAX, MAX).astype(jnp.float8_e4m3fn)


def dequantize(q, scales, dtype):
    """(q [C, H] e4m3fn, scales [C, nb] float32) -> [C, H] in dtype."""
    return (q.astype(jnp.float32) * _per_element(scales, q.shape[1])).astype(dtype)


def to_wire(q, scales):
    """(q, scales) -> [T, wire_bytes(H)] uint8 rows: payload bytes, then the scales' bytes."""
    payload = jax.lax.bitcast_convert_type(q, jnp.uint8)
    scale_bytes = jax.lax.bitcast_convert_type(scales, jnp.uint8).reshape(scales.shape[0], -1)
    return jnp.concatenate([payload, scale_bytes], axis=1)


def from_wire(wire, hidden: int):
    """[C, wire_bytes(H)] uint8 -> (q [C, H] e4m3fn, scales [C, nb] float32)."""
    q = jax.lax.bitcast_convert_type(wire[:, :hidden], jnp.float8_e4m3fn)
    scale_bytes = wire[:, hidden:].reshape(wire.shape[0], -1, 4)
    return q, jax.lax.bitcast_convert_type(scale_bytes, jnp.float32)
