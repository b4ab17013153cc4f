"""The `ffi` backend: XLA FFI custom calls with C++ host handlers (xla_ffi/cpu_handlers.cc).

Per shard, inside `jax.shard_map`. The fast level uses the direct-write transport: the ranks of an
EP group meet in a process-wide rendezvous (keyed by execution, call site, EP group and
generation; DESIGN §2.1.7) and each writes straight into its peers' receive buffers. The EP rank
and group id are operands, so the handlers never guess them from device ordinals.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np

from jax_hybridep import compat
from jax_hybridep.config import Plan
from jax_hybridep.handle import Handle, Layout

NAME = "ffi"
PLATFORMS = ("cpu",)  # CUDA handlers are not registered yet: see README "Backends".

# Every emitted custom call gets its own call-site id; repeated executions of one call site within
# an execution (scan, remat) are told apart by the handlers' generation counter.
_sites = itertools.count(1)


def unsupported_reason(plan_topology, manual_axes) -> str | None:
    """Why the ffi backend cannot run this call, or None when it can (checked at trace time)."""
    from jax_hybridep import _native  # noqa: PLC0415  (import registers the targets)

    if not _native.available():
        return f"the native module is not built ({_native.IMPORT_ERROR})"
    if plan_topology.platform not in PLATFORMS:
        return (
            f"this build has no '{plan_topology.platform}' handlers for the ffi backend "
            f"(available: {PLATFORMS})"
        )
    if len(plan_topology.levels) > 1:
        return "multi-level topologies run on the xla backend only, for now"
    if not plan_topology.single_process:
        return (
            "the EP group spans several processes; the ffi direct-write transport only connects "
            "devices of one process"
        )
    unmanaged = [a for a in plan_topology.group_axes if a not in manual_axes]
    if unmanaged:
        return (
            f"mesh axes {unmanaged} outside the EP group are not manual in the enclosing "
            "shard_map, so devices of different EP groups cannot be told apart; make every mesh "
            "axis manual (shard_map over all axes)"
        )
    return None


def _call(name, out_types, *args, like, plan: Plan, **attrs):
    results = jax.ffi.ffi_call(f"jax_hybridep_{name}", out_types)(
        *args,
        site=np.int64(next(_sites)),
        num_ranks=np.int64(plan.num_ranks),
        timeout_ms=np.int64(round(plan.config.resolved_timeout_s * 1000)),
        **attrs,
    )
    # FFI results come back typed as not varying over the manual axes; they vary like the
    # inputs and across the EP group.
    axes = set(plan.topology.ep_axes) | set(plan.topology.group_axes)
    axes &= compat.manual_axes()
    for a in like:
        axes |= compat.varying_axes(a)
    return jax.tree.map(lambda r: compat.mark_varying(r, axes), results)


def _i32(shape):
    return jax.ShapeDtypeStruct(shape, jnp.int32)


def layout(plan: Plan, topk_idx, rank, group) -> Layout:
    config = plan.config
    row_pos, group_sizes, tokens_per_expert, dropped, invalid = _call(
        "layout",
        (_i32(topk_idx.shape), _i32((plan.num_slots,)), _i32((plan.num_experts,)), _i32(()),
         _i32(())),
        topk_idx, rank, group,
        like=(topk_idx,),
        plan=plan,
        num_slots=np.int64(plan.num_slots),
        capacity=np.int64(-1 if plan.capacity is None else plan.capacity),
        rows=np.int64(plan.rows),
        pad_multiple=np.int64(config.pad_multiple),
        expert_rank=np.asarray(plan.expert_rank, np.int64),
        expert_slot=np.asarray(plan.expert_slot, np.int64),
        strict=np.bool_(config.strict),
    )  # fmt: skip
    return Layout(row_pos, group_sizes, tokens_per_expert, dropped, invalid)


def _send(plan: Plan, x, weights, row_pos, dest, rank, group):
    tokens, k = row_pos.shape
    return _call(
        "dispatch",
        (
            jax.ShapeDtypeStruct((plan.rows, x.shape[1]), x.dtype),
            jax.ShapeDtypeStruct((plan.rows,), jnp.float32),
            _i32((plan.num_ranks, tokens, k)),
            _i32((plan.num_ranks, tokens)),
        ),
        x, weights, row_pos, dest, rank, group,
        like=(x, weights, row_pos),
        plan=plan,
    )  # fmt: skip


def dispatch(plan: Plan, x, weights, row_pos, dest, rank, group):
    tokens, row_weights, recv_row_pos, recv_token = _send(
        plan, x, weights, row_pos, dest, rank, group
    )
    handle = Handle(row_pos, dest, rank, group, (recv_row_pos, recv_token), plan)
    return tokens, row_weights, handle


def level_rows(handle: Handle):
    """[1] int32: token copies this shard sent to other ranks (one per (token, remote rank))."""
    dest = handle.dest
    ranks = jnp.arange(handle.plan.num_ranks)
    to_rank = jnp.any(dest[:, :, None] == ranks, axis=1) & (ranks != handle.rank)  # [T, R]
    return jnp.sum(to_rank, dtype=jnp.int32)[None]


def redispatch(handle: Handle, g):
    """Rows [C, H] of g [T, H] along an existing dispatch (combine's VJP)."""
    zeros = jnp.zeros(handle.row_pos.shape, jnp.float32)
    rows, *_ = _send(handle.plan, g, zeros, handle.row_pos, handle.dest, handle.rank, handle.group)
    return rows


def combine(handle: Handle, y, weights):
    plan = handle.plan
    recv_row_pos, recv_token = handle.private
    weighted = weights is not None
    if not weighted:
        weights = jnp.zeros((plan.rows,), jnp.float32)  # ignored by the handler
    return _call(
        "combine",
        jax.ShapeDtypeStruct((plan.tokens, y.shape[1]), y.dtype),
        y, weights, recv_token, recv_row_pos, handle.dest, handle.rank, handle.group,
        like=(y, recv_row_pos),
        plan=plan,
        weighted=np.bool_(weighted),
    )  # fmt: skip


def return_row_values(handle: Handle, values):
    """[T, K] float32: values[row] sent back to the (t, k) each row came from; 0 elsewhere."""
    plan = handle.plan
    recv_row_pos, recv_token = handle.private
    return _call(
        "return_row_values",
        jax.ShapeDtypeStruct((plan.tokens, plan.k), jnp.float32),
        values, recv_token, recv_row_pos, handle.rank, handle.group,
        like=(values, recv_row_pos),
        plan=plan,
    )  # fmt: skip
