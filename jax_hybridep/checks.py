"""Trace-time checks of the ops' arguments (docs/design.md §2), and expert ids brought to int32 only
after they were checked in their own dtype.

Every failure is a ValueError or TypeError that names the argument, its shape or dtype and the
value expected, raised while tracing (before anything compiles or runs).
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_hybridep import compat, fp8
from jax_hybridep.config import DispatchConfig, DispatchPlan
from jax_hybridep.topology import Topology
from jax_hybridep.values import short

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)

# The int32 id every invalid id becomes (ids >= E or < -1 are invalid, docs/design.md §2.1.2).
INVALID_ID = -2


def check_context(op: str, topology: Topology, args) -> frozenset[str]:
    """Checks where the op runs; returns the manual mesh axes."""
    if any(compat.is_batched(a) for a in args):
        raise ValueError(
            f"jax_hybridep.{op} does not support jax.vmap: it exchanges data between EP ranks, "
            "so each shard must call it once; map over tokens instead (fold the batch into T)"
        )
    if not isinstance(topology, Topology):
        raise TypeError(
            f"jax_hybridep.{op}: topology must be a jax_hybridep.Topology (Topology.from_mesh), "
            f"got {type(topology).__name__}"
        )
    manual = compat.manual_axes()
    missing = [a for a in topology.ep_axes if a not in manual]
    if missing:
        raise ValueError(
            f"jax_hybridep.{op} must run inside jax.shard_map over the EP axes "
            f"{topology.ep_axes}; axes {missing} are not manual here (manual axes: "
            f"{sorted(manual)})"
        )
    shape = compat.context_mesh_shape()
    wrong = {a: shape[a] for a in topology.ep_axes if shape[a] != topology.axis_size(a)}
    if wrong:
        expected = {a: topology.axis_size(a) for a in wrong}
        raise ValueError(
            f"jax_hybridep.{op}: the topology was built for axis sizes {expected} but the "
            f"enclosing shard_map has {wrong}"
        )
    return manual


def check_config(op: str, config) -> DispatchConfig:
    """config itself, when it is a DispatchConfig."""
    if not isinstance(config, DispatchConfig):
        raise TypeError(
            f"jax_hybridep.{op}: config must be a jax_hybridep.DispatchConfig, got "
            f"{type(config).__name__} {short(config)}"
        )
    return config


def _check_quantized(x, config):
    """An already quantised x = (q [T, H] float8_e4m3fn, scales [T, ceil(H / 128)] float32)."""
    if not config.fp8_rows:
        raise ValueError(
            "x given as (q, scales) (already quantised) needs DispatchConfig(wire_dtype="
            "'float8_e4m3fn', fp8_rows=True): the rows then stay FP8 end to end"
        )
    if len(x) != 2:
        raise ValueError(f"a quantised x must be (q, scales), got a tuple of {len(x)}")
    return fp8.check_pair("quantised x", *x)


def check_dispatch_inputs(x, topk_idx, topk_weights, config=None):
    """(x, topk_idx, topk_weights) as arrays, checked: x [T, H] float (or, with fp8_rows, a
    quantised (q, scales)), ids [T, K] integer, weights [T, K] float, T, H, K >= 1."""
    if isinstance(x, list):  # jnp.asarray would stack or promote it: never what was meant
        raise TypeError(
            f"x must be an array [T, H] or, with fp8_rows, a tuple (q, scales); got a list of "
            f"{len(x)}{' (pass the quantised pair as a tuple)' if len(x) == 2 else ''}"
        )
    quantized = _check_quantized(x, config) if isinstance(x, tuple) else None
    x = jnp.asarray(quantized[0] if quantized else x)  # the rows: x, or the quantised payload
    topk_idx, topk_weights = jnp.asarray(topk_idx), jnp.asarray(topk_weights)
    if x.ndim != 2:
        raise ValueError(f"x must be [T, H], got shape {x.shape}")
    if topk_idx.ndim != 2:
        raise ValueError(f"topk_idx must be [T, K], got shape {topk_idx.shape}")
    if topk_weights.shape != topk_idx.shape:
        raise ValueError(
            f"topk_weights shape {topk_weights.shape} differs from topk_idx shape {topk_idx.shape}"
        )
    if x.shape[0] != topk_idx.shape[0]:
        raise ValueError(
            f"x has T={x.shape[0]} tokens (shape {x.shape}) but topk_idx has "
            f"T={topk_idx.shape[0]} (shape {topk_idx.shape})"
        )
    if 0 in x.shape or topk_idx.shape[1] == 0:
        raise ValueError(
            f"dispatch needs T >= 1, H >= 1 and K >= 1, got x {x.shape} [T, H] and topk_idx "
            f"{topk_idx.shape} [T, K]"
        )
    if quantized is None and x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    if not jnp.issubdtype(topk_idx.dtype, jnp.integer):
        raise TypeError(f"topk_idx must hold integer expert ids, got dtype {topk_idx.dtype}")
    if not jnp.issubdtype(topk_weights.dtype, jnp.floating):
        raise TypeError(f"topk_weights must be floating point, got dtype {topk_weights.dtype}")
    return (quantized or x), topk_idx, topk_weights


def expert_ids_int32(topk_idx, num_experts: int):
    """[T, K] int32 ids: valid ids and -1 ("no expert") kept, every other id INVALID_ID.

    Checked in the ids' own dtype first, so a wide or unsigned id the int32 cast would wrap into
    range (an int64 2**32 + 3, a uint32 2**32 - 1) is counted invalid, never routed.
    """
    dtype = topk_idx.dtype
    if dtype == jnp.int32:
        return topk_idx  # nothing to wrap; the layout counts ids outside [-1, E) as invalid
    signed = jnp.issubdtype(dtype, jnp.signedinteger)
    valid = topk_idx >= 0 if signed else jnp.ones(topk_idx.shape, bool)
    if num_experts <= jnp.iinfo(dtype).max:
        valid = valid & (topk_idx < num_experts)
    none = topk_idx == -1 if signed else jnp.zeros(topk_idx.shape, bool)
    safe = jnp.where(valid, topk_idx, 0).astype(jnp.int32)
    return jnp.where(valid, safe, jnp.where(none, -1, INVALID_ID)).astype(jnp.int32)


def check_combine_inputs(plan: DispatchPlan, y, weights):
    """(y, weights) as arrays, checked against the dispatch's plan: y [C, H'] float with H' >= 1,
    weights None or [C]."""
    args = (y,) if weights is None else (y, weights)
    check_context("combine", plan.topology, args)
    y = jnp.asarray(y)
    if y.ndim != 2 or y.shape[0] != plan.rows:
        raise ValueError(
            f"y must be [C, H] with C={plan.rows} rows (one per row of its dispatch), got shape "
            f"{y.shape}"
        )
    if y.shape[1] == 0:
        raise ValueError(f"combine needs H >= 1, got y of shape {y.shape}")
    if y.dtype not in FLOAT_DTYPES:
        raise TypeError(f"y must be float32, bfloat16 or float16, got {y.dtype}")
    if weights is not None:
        weights = jnp.asarray(weights)
        if weights.shape != (plan.rows,):
            raise ValueError(f"weights must be [C] = ({plan.rows},), got shape {weights.shape}")
        if not jnp.issubdtype(weights.dtype, jnp.floating):
            raise TypeError(f"weights must be floating point, got dtype {weights.dtype}")
    return y, weights
