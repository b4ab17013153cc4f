"""The `xla` backend: pure JAX on static padded buffers; the oracle for every other backend.

Per shard, inside `jax.shard_map` over the EP axes. Layout all-gathers per-expert counts over the
whole EP group and gives every (t, k) its row; then each level (slow -> fast) packs one copy per
(item, destination peer) into a static [S, M, H] buffer, compacted in ascending item order, and
exchanges it with `jax.lax.all_to_all` over that level's axes; the last level's receiver expands
into expert-major rows. Combine writes its float32 adds out one by one in the §2.1 order (k
ascending, then peers ascending at each level), so the `ffi` backend can match it bitwise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_hybridep import compat, weight_grad
from jax_hybridep.config import Plan
from jax_hybridep.errors import StrictModeError, strict_mode_message
from jax_hybridep.handle import Handle, Layout

NAME = "xla"


def _append_zero_row(x):
    """x with one zero row appended: index len(x) then reads zeros (gathers of 'no row')."""
    return jnp.concatenate([x, jnp.zeros((1,) + x.shape[1:], x.dtype)])


def _plan_groups(plan: Plan, totals):
    """Per (rank, slot): kept rows and group offset; the jnp twin of layout.cc:PlanGroups."""
    slot_expert = plan.slot_expert  # [R, L] static
    rows = jnp.where(slot_expert >= 0, totals[np.maximum(slot_expert, 0)], 0)
    pad, cap = plan.config.pad_multiple, plan.capacity

    def step(offset, rows_s):
        room = (plan.rows - offset) // pad * pad
        kept = jnp.minimum(rows_s, room)
        if cap is not None:
            kept = jnp.minimum(kept, cap)
        size = (kept + pad - 1) // pad * pad
        return offset + size, (kept, offset, size)

    zeros = compat.mark_varying(jnp.zeros(plan.num_ranks, jnp.int32), compat.varying_axes(rows))
    _, (kept, offset, size) = jax.lax.scan(step, zeros, rows.T)
    return kept.T, offset.T, size.T  # each [R, L]


def _strict_check(group, all_counts, invalid_per_rank, keep_limit):
    """Raises (through a host callback) the same error the ffi layout handler returns."""
    before = jnp.cumsum(all_counts, axis=0) - all_counts
    kept = jnp.clip(keep_limit[None, :] - before, 0, all_counts)
    dropped_per_rank = jnp.sum(all_counts - kept, axis=1)

    def check(group, dropped, invalid):
        if int(np.sum(dropped)) + int(np.sum(invalid)) > 0:
            raise StrictModeError(strict_mode_message(int(group), dropped, invalid))
        return np.int32(0)

    return jax.pure_callback(
        check, jax.ShapeDtypeStruct((), jnp.int32), group, dropped_per_rank, invalid_per_rank
    )


def gather_counts(plan: Plan, topk_idx):
    """This shard's rows per expert [E], invalid ids [], and every rank's both, all-gathered over
    the EP group as [R, E + 1] (E per-expert counts, then the invalid count); also used by the ffi
    backend when the group crosses processes."""
    num_experts = plan.num_experts
    valid = (topk_idx >= 0) & (topk_idx < num_experts)
    expert = jnp.where(valid, topk_idx, num_experts).reshape(-1)  # invalid -> sentinel E
    counts = jnp.zeros(num_experts + 1, jnp.int32).at[expert].add(1)[:num_experts]
    invalid = jnp.sum((topk_idx != -1) & ~valid, dtype=jnp.int32)
    gathered = jax.lax.all_gather(jnp.concatenate([counts, invalid[None]]), plan.topology.ep_axes)
    return counts, invalid, gathered


def copies_to_others(plan: Plan, level: int, rank, sent):
    """Copies a shard sent to other ranks at `level`; sent: [S, ...] bool, per peer first."""
    size, stride = plan.topology.level_sizes[level], plan.topology.level_strides[level]
    others = jnp.arange(size) != (rank // stride) % size
    return jnp.sum(sent & others.reshape((size,) + (1,) * (sent.ndim - 1)), dtype=jnp.int32)


def layout(plan: Plan, topk_idx, rank, group) -> Layout:
    num_experts, (tokens, k) = plan.num_experts, topk_idx.shape
    valid = (topk_idx >= 0) & (topk_idx < num_experts)
    expert = jnp.where(valid, topk_idx, num_experts).reshape(-1)  # invalid -> sentinel E
    counts, invalid, gathered = gather_counts(plan, topk_idx)
    all_counts, invalid_per_rank = gathered[:, :num_experts], gathered[:, num_experts]
    tokens_per_expert = jnp.sum(all_counts, axis=0)

    kept_rs, offset_rs, size_rs = _plan_groups(plan, tokens_per_expert)
    er, es = np.asarray(plan.expert_rank), np.asarray(plan.expert_slot)
    keep_limit, group_offset = kept_rs[er, es], offset_rs[er, es]  # [E]

    # Index of each row within its expert, in (source rank, t, k) order: rows from lower source
    # ranks, then this rank's earlier rows of the same expert (a stable sort by expert).
    before = (jnp.cumsum(all_counts, axis=0) - all_counts)[rank]
    order = jnp.argsort(expert, stable=True)
    starts = jnp.cumsum(counts) - counts
    starts = jnp.concatenate([starts, jnp.zeros(1, jnp.int32)])
    rank_sorted = jnp.arange(tokens * k, dtype=jnp.int32) - starts[expert[order]]
    local_index = jnp.zeros(tokens * k, jnp.int32).at[order].set(rank_sorted)
    safe = jnp.minimum(expert, num_experts - 1)
    index = before[safe] + local_index
    kept = valid.reshape(-1) & (index < keep_limit[safe])
    row_pos = jnp.where(kept, group_offset[safe] + index, -1).reshape(tokens, k)
    dropped = jnp.sum(valid.reshape(-1) & ~kept, dtype=jnp.int32)
    if plan.config.strict:
        # Adding the check's zero to row_pos, which every later step reads, keeps it from being
        # dead-code eliminated.
        row_pos = row_pos + _strict_check(group, all_counts, invalid_per_rank, keep_limit)
    return Layout(row_pos, size_rs[rank], tokens_per_expert, dropped, invalid)


# ----------------------------------------------------------------------------- levels
#
# Dispatch walks the levels slow -> fast. Entering level l, a rank holds M_l items (M_0 = T: its
# tokens), each with per-k metadata: the destination EP rank (-1 when that k has no row in this
# rank's subtree), the destination row and the routing weight. At level l the item goes once to
# every peer (the ranks differing from this one only in level l's coordinate) whose subtree holds
# one of its rows, carrying only the metadata of those rows. The S_l * M_l received items are the
# next level's items; after the last level every item's rows are on this rank and expand into
# expert-major rows. Combine walks back fast -> slow: partial sums per item, added over the peers
# of each level in ascending order, rounded to y's dtype as they cross (DESIGN §2.1.4).


def _level_all_to_all(plan: Plan, level: int, x):
    """Tiled all_to_all over one level's axes: chunk p of axis 0 goes to peer p."""
    return jax.lax.all_to_all(x, plan.topology.levels[level], 0, 0, tiled=True)


def _route_level(plan: Plan, level: int, held_dest):
    """For held items [M] with destinations [M, K]: their peer per k and the send layout.

    Returns (coord [M, K]: the peer at this level of each k's destination, -1 for none;
    send_item [S, M]: slot (p, j) -> item, -1 for empty; send_slot [M, S]: item -> its slot on p).
    """
    size, stride = plan.topology.level_sizes[level], plan.topology.level_strides[level]
    held = held_dest.shape[0]
    coord = jnp.where(held_dest >= 0, (held_dest // stride) % size, -1)
    to_peer = jnp.any(coord[:, :, None] == jnp.arange(size), axis=1)  # [M, S]
    send_slot = jnp.where(to_peer, jnp.cumsum(to_peer, axis=0, dtype=jnp.int32) - 1, -1)
    send_item = (
        jnp.full((size, held), -1, jnp.int32)
        .at[
            jnp.broadcast_to(jnp.arange(size), send_slot.shape),
            jnp.where(to_peer, send_slot, held),
        ]
        .set(
            jnp.broadcast_to(jnp.arange(held, dtype=jnp.int32)[:, None], send_slot.shape),
            mode="drop",
        )
    )
    return coord, send_item, send_slot


def _pack(send_item, x):
    """[S * M, ...]: x[send_item], zero where the slot is empty."""
    packed = _append_zero_row(x)[jnp.where(send_item >= 0, send_item, x.shape[0])]
    return packed.reshape((-1,) + x.shape[1:])


def _pack_metadata(send_item, coord, values, fill):
    """[S * M, K]: each sent item's values for the k whose destination is that peer, else fill."""
    size = send_item.shape[0]
    here = coord[None, :, :] == jnp.arange(size)[:, None, None]  # [S, M, K]
    per_peer = jnp.where(here, values[None], fill)
    picked = jnp.take_along_axis(per_peer, jnp.maximum(send_item, 0)[:, :, None], axis=1)
    return jnp.where((send_item >= 0)[:, :, None], picked, fill).reshape(-1, values.shape[1])


def _expand_rows(held_rows, row_src):
    """Expert-major rows [C, H] from the held items [M, H] (zero rows where unfilled)."""
    return _append_zero_row(held_rows)[row_src]


def send_levels(plan: Plan, held, levels):
    """Sends held items (x, dest, pos, weights) through `levels` (slow -> fast); returns the items
    held after the last of them and per level its record (send_item, send_slot, held_dest)."""
    k = plan.k
    held_x, held_dest, held_pos, held_w = held
    records = []
    for level in levels:
        coord, send_item, send_slot = _route_level(plan, level, held_dest)
        records.append((send_item, send_slot, held_dest))
        meta = jnp.concatenate(
            [_pack_metadata(send_item, coord, held_dest, -1),
             _pack_metadata(send_item, coord, held_pos, -1)], axis=1)  # fmt: skip
        meta = _level_all_to_all(plan, level, meta)
        held_dest, held_pos = meta[:, :k], meta[:, k:]
        held_w = _level_all_to_all(plan, level, _pack_metadata(send_item, coord, held_w, 0.0))
        held_x = _level_all_to_all(plan, level, _pack(send_item, held_x))
    return (held_x, held_dest, held_pos, held_w), tuple(records)


def forward_levels(plan: Plan, records, g):
    """g [T, H] carried along recorded levels: what each rank holds after them."""
    held = g
    for level, (send_item, _, _) in enumerate(records):
        held = _level_all_to_all(plan, level, _pack(send_item, held))
    return held


def reduce_levels(plan: Plan, records, partials, dtype):
    """Per-item partials after the recorded levels, added back over them (fast -> slow)."""
    for level in reversed(range(len(records))):
        partials = _reduce_level(plan, level, records[level][1], partials, dtype)
    return partials


def pick_levels(plan: Plan, records, per_item):
    """Per-item values [M, K] after the recorded levels, returned over them to the (t, k)."""
    for level in reversed(range(len(records))):
        _, send_slot, held_dest = records[level]
        size, stride = plan.topology.level_sizes[level], plan.topology.level_strides[level]
        back = _level_all_to_all(plan, level, per_item).reshape(size, -1, plan.k)
        coord = jnp.where(held_dest >= 0, (held_dest // stride) % size, 0)
        slot = jnp.maximum(jnp.take_along_axis(send_slot, coord, axis=1), 0)
        picked = back[coord, slot, jnp.arange(plan.k)[None, :]]
        per_item = jnp.where(held_dest >= 0, picked, 0.0)
    return per_item


def dispatch(plan: Plan, x, weights, row_pos, dest, rank, group):
    k = plan.k
    held, levels = send_levels(plan, (x, dest, row_pos, weights), range(len(plan.topology.levels)))
    held_x, _, held_pos, held_w = held
    flat_pos = held_pos.reshape(-1)
    target = jnp.where(flat_pos >= 0, flat_pos, plan.rows)
    held = held_pos.shape[0]
    item_ids = jnp.repeat(jnp.arange(held, dtype=jnp.int32), k)
    row_src = jnp.full(plan.rows, held, jnp.int32).at[target].set(item_ids, mode="drop")
    tokens_out = _expand_rows(held_x, row_src)
    row_weights = jnp.zeros(plan.rows, jnp.float32).at[target].set(held_w.reshape(-1), mode="drop")
    handle = Handle(row_pos, dest, rank, group, (levels, held_pos, row_src), plan)
    return tokens_out, row_weights, handle


def level_rows(handle: Handle):
    """[levels] int32: item copies this shard sent to other ranks at each level (the payload rows
    that crossed that level's links; copies a rank keeps for itself do not count)."""
    levels, _, _ = handle.private
    return jnp.stack(
        [
            copies_to_others(handle.plan, level, handle.rank, send_item >= 0)
            for level, (send_item, _, _) in enumerate(levels)
        ]
    )


def redispatch(handle: Handle, g):
    """Rows [C, H] of g [T, H] along an existing dispatch (combine's VJP)."""
    levels, _, row_src = handle.private
    return _expand_rows(forward_levels(handle.plan, levels, g), row_src)


def combine_vjp(handle: Handle, g, y, weights):
    """A weighted combine's VJP: (rows * weights[:, None] in float32 rounded to g's dtype,
    the routing-weight gradient weight_grad.row_dot(y, rows)), rows = redispatch(g)."""
    rows = redispatch(handle, g)
    scaled = (rows.astype(jnp.float32) * weights[:, None]).astype(rows.dtype)
    return scaled, weight_grad.row_dot(handle.plan.topology.platform, y, rows)


def _reduce_level(plan: Plan, level: int, send_slot, partials, dtype):
    """Per held item: its peers' partials [S * M, H] added in ascending peer order, in float32."""
    size = plan.topology.level_sizes[level]
    back = _level_all_to_all(plan, level, partials).reshape(size, -1, partials.shape[-1])

    def add_partial(p, acc):
        slot = send_slot[:, p]
        part = back[p][jnp.maximum(slot, 0)].astype(jnp.float32)
        return jnp.where((slot >= 0)[:, None], acc + part, acc)

    zeros = jnp.zeros((send_slot.shape[0], partials.shape[-1]), jnp.float32)
    zeros = compat.mark_varying(zeros, compat.varying_axes(back))
    return jax.lax.fori_loop(0, size, add_partial, zeros).astype(dtype)


def combine(handle: Handle, y, weights):
    plan = handle.plan
    levels, held_pos, _ = handle.private
    rows = y.astype(jnp.float32)
    if weights is not None:
        # The barrier keeps XLA from contracting this multiply with the adds below into an FMA,
        # which the host kernels (built with -ffp-contract=off) do not do.
        rows = jax.lax.optimization_barrier(rows * weights[:, None])
    rows = _append_zero_row(rows)
    acc = jnp.zeros((held_pos.shape[0], y.shape[1]), jnp.float32)
    for kk in range(plan.k):  # this rank's rows of each held item, k ascending
        pos = held_pos[:, kk]
        acc = jnp.where((pos >= 0)[:, None], acc + rows[jnp.where(pos >= 0, pos, plan.rows)], acc)
    return reduce_levels(plan, levels, acc.astype(y.dtype), y.dtype)


def return_row_values(handle: Handle, values):
    """[T, K] float32: values[row] sent back to the (t, k) each row came from; 0 elsewhere."""
    plan = handle.plan
    levels, held_pos, _ = handle.private
    per_item = _append_zero_row(values)[jnp.where(held_pos >= 0, held_pos, plan.rows)]
    return pick_levels(plan, levels, per_item)
