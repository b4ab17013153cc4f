"""The `ffi` backend: XLA FFI custom calls with C++ host handlers (xla_ffi/cpu_*handlers.cc).

Per shard, inside `jax.shard_map`. Levels whose ranks share a process exchange through shared
memory: the ranks meet in a process-wide rendezvous (keyed by execution, call site, group and
generation; DESIGN §2.1.7); the fused one-level path then reads straight from the peers' inputs
(each destination copies its rows from the sources' x, each source sums its partials from the
destinations' rows: one copy per row, no staging); the level steps write dispatch's item copies
straight into the peers' buffers and read combine's partials in place from the peers. Levels
that cross processes pack with a custom call and exchange with an XLA all-to-all. A one-level
topology in one process takes the fused path (one custom call per direction); every other
topology composes the per-level steps in the same order as the `xla` backend, so both agree
bitwise. The EP rank and group ids are operands, so the handlers never guess them from device
ordinals.

On GPUs the backend is backends/ffi_gpu.py (CUDA handlers over the direct-write transport).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_hybridep.backends import xla
from jax_hybridep.backends.ffi_call import call as _call
from jax_hybridep.backends.ffi_call import i32 as _i32
from jax_hybridep.backends.ffi_call import layout_attrs as _layout_attrs
from jax_hybridep.backends.ffi_call import level_peer as _level_peer
from jax_hybridep.config import Plan
from jax_hybridep.handle import Handle, Layout

NAME = "ffi"


def unsupported_reason(plan_topology, manual_axes) -> str | None:
    """Why the ffi backend cannot run this call, or None when it can (checked at trace time)."""
    from jax_hybridep import _native  # noqa: PLC0415  (import registers the targets)

    if not _native.available():
        return f"the native module is not built ({_native.IMPORT_ERROR})"
    platforms = _native.platforms()
    if plan_topology.platform not in platforms:
        return (
            f"this build has no '{plan_topology.platform}' handlers for the ffi backend "
            f"(available: {platforms})"
        )
    unmanaged = [a for a in plan_topology.group_axes if a not in manual_axes]
    if unmanaged:
        return (
            f"mesh axes {unmanaged} outside the EP group are not manual in the enclosing "
            "shard_map, so devices of different EP groups cannot be told apart; make every mesh "
            "axis manual (shard_map over all axes)"
        )
    return None


def layout(plan: Plan, topk_idx, rank, group) -> Layout:
    out_types = (_i32(topk_idx.shape), _i32((plan.num_slots,)), _i32((plan.num_experts,)),
                 _i32(()), _i32(()))  # fmt: skip
    if plan.topology.single_process:  # counts all-gathered through the rendezvous
        outs = _call("layout", out_types, topk_idx, rank, group, like=(topk_idx,), plan=plan,
                     **_layout_attrs(plan))  # fmt: skip
    else:  # counts all-gathered by an XLA collective across the processes
        _, _, gathered = xla.gather_counts(plan, topk_idx)
        outs = _call("layout_gathered", out_types, topk_idx, gathered, rank, group,
                     like=(topk_idx, gathered), plan=plan, exchange=False,
                     **_layout_attrs(plan))  # fmt: skip
    return Layout(*outs)


def _fused(plan: Plan) -> bool:
    """One level inside one process: the fused one-call-per-direction path."""
    return len(plan.topology.levels) == 1 and plan.topology.level_local[0]


# ----------------------------------------------------------------------------- fused (one level)


def _send(plan: Plan, x, weights, row_pos, dest, rank, group):
    """Expert-major rows [C, H] and their weights [C]: each destination reads its rows straight
    from the sources' x (host pull transport, xla_ffi/exchange.h)."""
    return _call(
        "dispatch",
        (
            jax.ShapeDtypeStruct((plan.rows, x.shape[1]), x.dtype),
            jax.ShapeDtypeStruct((plan.rows,), jnp.float32),
        ),
        x, weights, row_pos, dest, rank, group,
        like=(x, weights, row_pos),
        plan=plan,
    )  # fmt: skip


def _fused_combine(handle: Handle, y, weights, weighted):
    plan = handle.plan
    return _call(
        "combine",
        jax.ShapeDtypeStruct((plan.tokens, y.shape[1]), y.dtype),
        y, weights, handle.row_pos, handle.dest, handle.rank, handle.group,
        like=(y, handle.row_pos),
        plan=plan,
        weighted=np.bool_(weighted),
    )  # fmt: skip


def _fused_return_row_values(handle: Handle, values):
    plan = handle.plan
    return _call(
        "return_row_values",
        jax.ShapeDtypeStruct((plan.tokens, plan.k), jnp.float32),
        values, handle.row_pos, handle.dest, handle.rank, handle.group,
        like=(values, handle.row_pos),
        plan=plan,
    )  # fmt: skip


# ----------------------------------------------------------------------------- level by level
#
# The same walk as the xla backend (see its module): per level, each held item goes once to every
# peer holding one of its rows; the last level expands into rows; combine returns partials level
# by level and each sender adds its peers' in ascending order.


def _level_exchange(plan: Plan, level: int, data, rank, group):
    """All-to-all of [S * n, ...] over one level: direct write in-process, else XLA's."""
    if not plan.topology.level_local[level]:
        return jax.lax.all_to_all(data, plan.topology.levels[level], 0, 0, tiled=True)
    coord, level_group = _level_peer(plan, level, rank, group)
    size = plan.topology.level_sizes[level]
    return _call("blocks_all_to_all", jax.ShapeDtypeStruct(data.shape, data.dtype), data, coord,
                 level_group, like=(data,), plan=plan, num_ranks=np.int64(size))  # fmt: skip


def _send_level(plan: Plan, level: int, held, rank, group):
    """(next level's items, send_slot [M, S]) for held items (rows, dest, pos, weights)."""
    rows, dest = held[0], held[1]
    size, stride = plan.topology.level_sizes[level], plan.topology.level_strides[level]
    items, k = dest.shape
    out_types = (
        jax.ShapeDtypeStruct((size * items, rows.shape[1]), rows.dtype),
        _i32((size * items, k)),
        _i32((size * items, k)),
        jax.ShapeDtypeStruct((size * items, k), jnp.float32),
        _i32((items, size)),
    )
    attrs = dict(num_ranks=np.int64(size), stride=np.int64(stride))
    if plan.topology.level_local[level]:
        coord, level_group = _level_peer(plan, level, rank, group)
        *nxt, send_slot = _call("level_send", out_types, *held, coord, level_group, like=held,
                                plan=plan, **attrs)  # fmt: skip
        return tuple(nxt), send_slot
    *packed, send_slot = _call("level_pack", out_types, *held, like=held, plan=plan,
                               exchange=False, **attrs)  # fmt: skip
    axes = plan.topology.levels[level]
    return tuple(jax.lax.all_to_all(a, axes, 0, 0, tiled=True) for a in packed), send_slot


def _walk_levels(plan: Plan, held, rank, group):
    """Sends held items through every level; returns the last items and per-level records."""
    levels = []  # per level: (send_slot, held_dest, held_pos)
    for level in range(len(plan.topology.levels)):
        nxt, send_slot = _send_level(plan, level, held, rank, group)
        levels.append((send_slot, held[1], held[2]))
        held = nxt
    return held, tuple(levels)


def _expand(plan: Plan, held):
    rows, _, pos, weights = held
    return _call(
        "expand_items",
        (jax.ShapeDtypeStruct((plan.rows, rows.shape[1]), rows.dtype),
         jax.ShapeDtypeStruct((plan.rows,), jnp.float32)),
        rows, pos, weights, like=(rows, pos), plan=plan, exchange=False,
    )  # fmt: skip


def _forward_levels(handle: Handle, g):
    """g [T, H] carried along the dispatch's levels: what each rank holds before expanding."""
    levels, _ = handle.private
    held = g
    for level, (_, dest, pos) in enumerate(levels):
        zeros = jnp.zeros(dest.shape, jnp.float32)
        (held, *_), _ = _send_level(handle.plan, level, (held, dest, pos, zeros), handle.rank,
                                    handle.group)  # fmt: skip
    return held


def _levels_redispatch(handle: Handle, g):
    held, (_, held_pos) = _forward_levels(handle, g), handle.private
    return _expand(handle.plan, (held, None, held_pos, jnp.zeros(held_pos.shape, jnp.float32)))[0]


def _levels_combine(handle: Handle, y, weights, weighted):
    plan = handle.plan
    levels, held_pos = handle.private
    partials = _call(
        "item_partials",
        jax.ShapeDtypeStruct((held_pos.shape[0], y.shape[1]), y.dtype),
        y, weights, held_pos, like=(y, held_pos), plan=plan, exchange=False,
        weighted=np.bool_(weighted),
    )  # fmt: skip
    for level in reversed(range(len(levels))):
        send_slot = levels[level][0]
        out_type = jax.ShapeDtypeStruct((send_slot.shape[0], y.shape[1]), y.dtype)
        if plan.topology.level_local[level]:  # each rank reads its peers' partials in place
            coord, level_group = _level_peer(plan, level, handle.rank, handle.group)
            size = np.int64(plan.topology.level_sizes[level])
            partials = _call("level_reduce_pull", out_type, partials, send_slot, coord,
                             level_group, like=(partials, send_slot), plan=plan,
                             num_ranks=size)  # fmt: skip
            continue
        back = jax.lax.all_to_all(partials, plan.topology.levels[level], 0, 0, tiled=True)
        partials = _call("level_reduce", out_type, back, send_slot, like=(back, send_slot),
                         plan=plan, exchange=False)  # fmt: skip
    return partials


def _levels_return_row_values(handle: Handle, values):
    plan = handle.plan
    levels, held_pos = handle.private
    per_item = jnp.where(held_pos >= 0, jnp.append(values, 0.0)[held_pos], 0.0)
    for level in reversed(range(len(levels))):
        send_slot, held_dest, _ = levels[level]
        back = _level_exchange(plan, level, per_item, handle.rank, handle.group)
        per_item = _call(
            "level_pick",
            jax.ShapeDtypeStruct(held_dest.shape, jnp.float32),
            back, send_slot, held_dest, like=(back, held_dest), plan=plan, exchange=False,
            stride=np.int64(plan.topology.level_strides[level]),
        )  # fmt: skip
    return per_item


# ----------------------------------------------------------------------------- backend interface


def dispatch(plan: Plan, x, weights, row_pos, dest, rank, group):
    if _fused(plan):
        tokens, row_weights = _send(plan, x, weights, row_pos, dest, rank, group)
        return tokens, row_weights, Handle(row_pos, dest, rank, group, (), plan)
    held, levels = _walk_levels(plan, (x, dest, row_pos, weights), rank, group)
    tokens, row_weights = _expand(plan, held)
    return tokens, row_weights, Handle(row_pos, dest, rank, group, (levels, held[2]), plan)


def level_rows(handle: Handle):
    """[levels] int32: item copies this shard sent to other ranks at each level."""
    plan = handle.plan
    if _fused(plan):  # one copy per (token, remote rank)
        ranks = jnp.arange(plan.num_ranks)
        to_rank = jnp.any(handle.dest[:, :, None] == ranks, axis=1) & (ranks != handle.rank)
        return jnp.sum(to_rank, dtype=jnp.int32)[None]
    levels, _ = handle.private
    return jnp.stack(
        [
            xla.copies_to_others(plan, level, handle.rank, send_slot.T >= 0)
            for level, (send_slot, _, _) in enumerate(levels)
        ]
    )


def redispatch(handle: Handle, g):
    """Rows [C, H] of g [T, H] along an existing dispatch (combine's VJP)."""
    if not _fused(handle.plan):
        return _levels_redispatch(handle, g)
    zeros = jnp.zeros(handle.row_pos.shape, jnp.float32)
    rows, _ = _send(handle.plan, g, zeros, handle.row_pos, handle.dest, handle.rank, handle.group)
    return rows


def combine_vjp(handle: Handle, g, y, weights):
    """A weighted combine's VJP, (scaled rows, routing-weight gradient) as xla.combine_vjp, in
    one pass of the handlers: the rows of g are never stored (weight_grad's fixed order)."""
    plan = handle.plan
    out_types = (jax.ShapeDtypeStruct((plan.rows, g.shape[1]), g.dtype),
                 jax.ShapeDtypeStruct((plan.rows,), jnp.float32))  # fmt: skip
    if _fused(plan):
        return _call("combine_vjp", out_types, g, weights, y, handle.row_pos, handle.dest,
                     handle.rank, handle.group, like=(g, handle.row_pos), plan=plan)  # fmt: skip
    held, (_, held_pos) = _forward_levels(handle, g), handle.private
    return _call("expand_items_vjp", out_types, held, held_pos, weights, y,
                 like=(held, held_pos), plan=plan, exchange=False)  # fmt: skip


def combine(handle: Handle, y, weights):
    weighted = weights is not None
    if not weighted:
        weights = jnp.zeros((handle.plan.rows,), jnp.float32)  # ignored by the handlers
    if _fused(handle.plan):
        return _fused_combine(handle, y, weights, weighted)
    return _levels_combine(handle, y, weights, weighted)


def return_row_values(handle: Handle, values):
    """[T, K] float32: values[row] sent back to the (t, k) each row came from; 0 elsewhere."""
    if _fused(handle.plan):
        return _fused_return_row_values(handle, values)
    return _levels_return_row_values(handle, values)
