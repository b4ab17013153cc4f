"""Emitting the ffi backend's custom calls (host and CUDA handlers alike)."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np

from jax_hybridep import compat
from jax_hybridep.config import Plan

# Every emitted custom call gets its own call-site id; repeated executions of one call site within
# an execution (scan, remat) are told apart by the handlers' generation counter.
_sites = itertools.count(1)


def next_site() -> np.int64:
    return np.int64(next(_sites))


def call(name, out_types, *args, like, plan: Plan, exchange=True, **attrs):
    """One custom call jax_hybridep_<name>; an exchange also gets its call site, group size and
    timeout. `like`: the inputs whose varying manual axes the results share."""
    if exchange:
        attrs = dict(
            site=next_site(),
            timeout_ms=np.int64(round(plan.config.resolved_timeout_s * 1000)),
            **{"num_ranks": np.int64(plan.num_ranks), **attrs},
        )
    results = jax.ffi.ffi_call(f"jax_hybridep_{name}", out_types)(*args, **attrs)
    # FFI results come back typed as not varying over the manual axes; they vary like the
    # inputs and across the EP group.
    axes = set(plan.topology.ep_axes) | set(plan.topology.group_axes)
    axes &= compat.manual_axes()
    for a in like:
        axes |= compat.varying_axes(a)
    return jax.tree.map(lambda r: compat.mark_varying(r, axes), results)


def i32(shape):
    return jax.ShapeDtypeStruct(shape, jnp.int32)


def layout_attrs(plan: Plan):
    config = plan.config
    return dict(
        num_ranks=np.int64(plan.num_ranks),
        num_slots=np.int64(plan.num_slots),
        capacity=np.int64(-1 if plan.capacity is None else plan.capacity),
        rows=np.int64(plan.rows),
        pad_multiple=np.int64(config.pad_multiple),
        expert_rank=np.asarray(plan.expert_rank, np.int64),
        expert_slot=np.asarray(plan.expert_slot, np.int64),
        strict=np.bool_(config.strict),
    )


def level_peer(plan: Plan, level: int, rank, group):
    """This rank's coordinate in the level and an id of its level group (for the rendezvous and
    the GPU windows)."""
    size, stride = plan.topology.level_sizes[level], plan.topology.level_strides[level]
    coord = (rank // stride) % size
    return coord, group * plan.num_ranks + (rank - coord * stride)
