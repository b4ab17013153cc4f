"""FP8 on the wire (docs/design.md §2.1.8): each token quantised once at the source to float8_e4m3fn
with one float32 scale per block of 128 elements of H (the last block shorter), dequantised at
the receiver. The jnp formula here is the oracle; xla_ffi/common/fp8.h computes the same bits.

Per token and block, in float32 without fused multiply-add:
  amax = max(max |x_i| over the finite x_i of the block, 1e-4)
  scale = amax * (1 / 448);  inv = 448 / amax
  q_i = e4m3fn(clamp(x_i * inv, -448, 448))     (round to nearest even; NaN stays NaN)
  x_i' = float32(q_i) * scale, rounded once to x's dtype.

Wire rows (the host handlers' and the traffic count's unit): H payload bytes, then the block
scales, `wire_bytes(H) = H + 4 * ceil(H / 128)` bytes per token copy.

Every function checks its arguments' shapes and dtypes while tracing (ValueError/TypeError).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_hybridep.values import check_int, short

WIRE_DTYPES = ("float8_e4m3fn",)
BLOCK = 128
MAX = np.float32(448.0)
MIN_AMAX = np.float32(1e-4)
INV_MAX = np.float32(1.0) / MAX  # 1 / 448 rounded to float32, as the C++ constant expression


def wire_dtype_name(value, name: str = "wire_dtype") -> str | None:
    """None, or the name of a wire dtype in WIRE_DTYPES given as a name or a dtype."""
    if value is None:
        return None
    given = value
    if not isinstance(value, str):
        try:
            value = np.dtype(value).name
        except TypeError:
            raise TypeError(
                f"{name} must be None or one of {WIRE_DTYPES}, got {short(given)}"
            ) from None
    if value not in WIRE_DTYPES:
        raise ValueError(f"{name} must be None (x's dtype) or one of {WIRE_DTYPES}, got {given!r}")
    return value


def num_blocks(hidden: int) -> int:
    """ceil(hidden / 128): block scales per token."""
    return -(-check_int("hidden", hidden, 1) // BLOCK)


def wire_bytes(hidden: int) -> int:
    """Bytes one token copy carries: payload plus its block scales."""
    return hidden + 4 * num_blocks(hidden)


def check_pair(what: str, q, scales):
    """(q, scales) as arrays: q [T, H] float8_e4m3fn, scales [T, ceil(H / 128)] float32."""
    q, scales = jnp.asarray(q), jnp.asarray(scales)
    if q.dtype != jnp.float8_e4m3fn or scales.dtype != jnp.float32:
        raise TypeError(
            f"{what}: (q, scales) must be float8_e4m3fn and float32, got {q.dtype} and "
            f"{scales.dtype}"
        )
    if q.ndim != 2 or 0 in q.shape:
        raise ValueError(f"{what}: q must be [T, H] with T, H >= 1, got shape {q.shape}")
    want = (q.shape[0], num_blocks(q.shape[1]))
    if scales.shape != want:
        raise ValueError(
            f"{what}: scales must be {list(want)} float32 (one per 128 elements of H="
            f"{q.shape[1]}), got {scales.dtype}{list(scales.shape)}"
        )
    return q, scales


def _check_float_dtype(name: str, dtype):
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        raise TypeError(f"{name} must be a float dtype, got {short(dtype)}") from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{name} must be a float dtype, got {dtype}")
    return dtype


def _per_element(blocks, hidden: int):
    """[T, num_blocks] -> [T, H]: each element's block value."""
    return jnp.repeat(blocks, BLOCK, axis=1)[:, :hidden]


def quantize(x):
    """x [T, H] float -> (q [T, H] float8_e4m3fn, scales [T, ceil(H / 128)] float32)."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"quantize: x must be floating point, got {x.dtype}")
    if x.ndim != 2 or 0 in x.shape:
        raise ValueError(f"quantize: x must be [T, H] with T, H >= 1, got shape {x.shape}")
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
    if jnp.result_type(x32) != jnp.float32 or jnp.result_type(inv) != jnp.float32:
        raise TypeError(
            f"cast: x32 and inv must be float32, got {jnp.result_type(x32)} and "
            f"{jnp.result_type(inv)}"
        )
    # The barrier keeps XLA from fusing the multiply into the convert differently from the
    # C++ kernels, which round x * inv to float32 first.
    scaled = jax.lax.optimization_barrier(x32 * inv)
    return jnp.clip(scaled, -MAX, MAX).astype(jnp.float8_e4m3fn)


def dequantize(q, scales, dtype):
    """(q [C, H] e4m3fn, scales [C, nb] float32) -> [C, H] in dtype."""
    q, scales = check_pair("dequantize", q, scales)
    dtype = _check_float_dtype("dequantize: dtype", dtype)
    return (q.astype(jnp.float32) * _per_element(scales, q.shape[1])).astype(dtype)


def to_wire(q, scales):
    """(q, scales) -> [T, wire_bytes(H)] uint8 rows: payload bytes, then the scales' bytes."""
    q, scales = check_pair("to_wire", q, scales)
    payload = jax.lax.bitcast_convert_type(q, jnp.uint8)
    scale_bytes = jax.lax.bitcast_convert_type(scales, jnp.uint8).reshape(scales.shape[0], -1)
    return jnp.concatenate([payload, scale_bytes], axis=1)


def from_wire(wire, hidden: int):
    """[C, wire_bytes(H)] uint8 -> (q [C, H] e4m3fn, scales [C, nb] float32)."""
    wire = jnp.asarray(wire)
    if wire.ndim != 2 or wire.dtype != jnp.uint8 or wire.shape[1] != wire_bytes(hidden):
        raise ValueError(
            f"from_wire: wire must be [C, wire_bytes({hidden})={wire_bytes(hidden)}] uint8, got "
            f"{wire.dtype}{list(wire.shape)}"
        )
    q = jax.lax.bitcast_convert_type(wire[:, :hidden], jnp.float8_e4m3fn)
    scale_bytes = wire[:, hidden:].reshape(wire.shape[0], -1, 4)
    return q, jax.lax.bitcast_convert_type(scale_bytes, jnp.float32)
