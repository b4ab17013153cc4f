"""The experts' settings (`ExpertConfig`) and their per-shard computation over expert-major rows
(the output of `dispatch`).

`group_sizes[e]` consecutive rows belong to local expert e, packed from row 0; rows after the
last group are padding. On GPUs the experts run as `jax.lax.ragged_dot`. On CPU `ragged_dot`
lowers to a dense masked computation (E_local x the FLOPs and memory), so with a capacity each
expert instead runs over a window of `capacity` rows starting at its group (docs/design.md §5).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_hybridep import compat
from jax_hybridep.values import check_int


@dataclasses.dataclass(frozen=True)
class ExpertConfig:
    """What each routed expert (and the optional always-on shared expert) is.

    Attributes:
      d_ff: each routed expert's hidden width F.
      shared_ff: hidden width of an always-on shared expert applied to every token, or None
        for none.
      dtype: compute dtype of the experts (the dispatched rows travel in it); a floating dtype.
      param_dtype: dtype the expert (and router) parameters are stored in; a floating dtype.
    """

    d_ff: int
    shared_ff: int | None = None
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    def __post_init__(self):
        check_int("ExpertConfig.d_ff", self.d_ff, 1)
        if self.shared_ff is not None:
            check_int("ExpertConfig.shared_ff", self.shared_ff, 1)
        for name in ("dtype", "param_dtype"):
            object.__setattr__(self, name, _floating(f"ExpertConfig.{name}", getattr(self, name)))


def _floating(name: str, value) -> jnp.dtype:
    """value as a floating jnp dtype (TypeError otherwise)."""
    try:
        dtype = jnp.dtype(value)
    except TypeError:
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating dtype (e.g. jnp.bfloat16), got {value!r}")
    return dtype


def swiglu(x, w_gate, w_up, w_down):
    """SwiGLU FFN: (silu(x @ w_gate) * (x @ w_up)) @ w_down."""
    return jnp.dot(jax.nn.silu(jnp.dot(x, w_gate)) * jnp.dot(x, w_up), w_down)


def _ragged_swiglu(rows, group_sizes, w_gate, w_up, w_down):
    h = jax.nn.silu(jax.lax.ragged_dot(rows, w_gate, group_sizes))
    h = h * jax.lax.ragged_dot(rows, w_up, group_sizes)
    return jax.lax.ragged_dot(h, w_down, group_sizes)


def _windowed_swiglu(rows, group_sizes, w_gate, w_up, w_down, capacity):
    """Each expert over `capacity` rows from its group's start; rows outside its group give 0."""
    num_rows = rows.shape[0]
    # Windows may run past the last row: pad so dynamic_slice never shifts a window back.
    padded = jnp.concatenate([rows, jnp.zeros((capacity, rows.shape[1]), rows.dtype)])
    starts = jnp.cumsum(group_sizes, dtype=jnp.int32) - group_sizes
    out = jnp.zeros((num_rows + capacity, w_down.shape[-1]), rows.dtype)
    varying = frozenset().union(*(compat.varying_axes(a) for a in (rows, w_gate, w_up, w_down)))
    out = compat.mark_varying(out, varying)  # the scan carry must vary like what it absorbs

    def one_expert(out, per_expert):
        start, size, wg, wu, wd = per_expert
        mine = (jnp.arange(capacity) < size)[:, None]
        # Rows past the group (the next group's, or unspecified padding that may be NaN) are
        # selected away before and after the expert, so neither its output nor its gradient
        # ever reads them.
        window = jnp.where(mine, jax.lax.dynamic_slice_in_dim(padded, start, capacity), 0)
        y = jnp.where(mine, swiglu(window, wg, wu, wd), 0).astype(out.dtype)
        # Experts go in ascending order and each group starts where the previous one ends, so a
        # window's tail (zeros) is overwritten by the next expert's rows.
        return jax.lax.dynamic_update_slice_in_dim(out, y, start, axis=0), None

    out, _ = jax.lax.scan(one_expert, out, (starts, group_sizes, w_gate, w_up, w_down))
    return out[:num_rows]


def expert_swiglu(rows, group_sizes, w_gate, w_up, w_down, *, capacity=None, platform="cpu"):
    """SwiGLU of each local expert over its rows.

    Args:
      rows: [C, H] expert-major rows.
      group_sizes: [L] int32 rows per local expert.
      w_gate, w_up: [L, H, F]; w_down: [L, F, H'].
      capacity: rows per expert when the dispatch had a capacity (enables the CPU window path).
      platform: "cpu" or an accelerator platform name.

    Returns:
      [C, H'] in rows' dtype; padding rows are 0.
    """
    if platform == "cpu" and capacity is not None:
        return _windowed_swiglu(rows, group_sizes, w_gate, w_up, w_down, capacity)
    return _ragged_swiglu(rows, group_sizes, w_gate, w_up, w_down).astype(rows.dtype)
