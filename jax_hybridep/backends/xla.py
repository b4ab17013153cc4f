"""The `xla` backend: pure JAX on static padded buffers; the oracle for every other backend.

Per shard, inside `jax.shard_map` over the EP axes. One exchange level = layout (all-gather of
per-expert counts, then every (t, k)'s row), pack (one copy per (token, destination rank) into a
[R, T, H] send buffer, compacted in ascending t), `jax.lax.all_to_all`, and expansion into
expert-major rows on the receiver. Combine writes its float32 adds out one by one in the §2.1
order (k ascending, then destination rank ascending), so the `ffi` backend can match it bitwise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_hybridep import compat
from jax_hybridep.config import Plan
from jax_hybridep.errors import StrictModeError, strict_mode_message
from jax_hybridep.handle import Handle, Layout

NAME = "xla"


def _all_to_all(plan: Plan, x):
    return jax.lax.all_to_all(x, plan.topology.ep_axes, 0, 0, tiled=True)


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


def _strict_check(plan: Plan, group, all_counts, invalid_per_rank, keep_limit):
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


def layout(plan: Plan, topk_idx, rank, group) -> Layout:
    num_experts, (tokens, k) = plan.num_experts, topk_idx.shape
    valid = (topk_idx >= 0) & (topk_idx < num_experts)
    expert = jnp.where(valid, topk_idx, num_experts).reshape(-1)  # invalid -> sentinel E
    counts = jnp.zeros(num_experts + 1, jnp.int32).at[expert].add(1)[:num_experts]
    invalid = jnp.sum((topk_idx != -1) & ~valid, dtype=jnp.int32)
    gathered = jax.lax.all_gather(
        jnp.concatenate([counts, invalid[None]]), plan.topology.ep_axes
    )  # [R, E + 1]
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
        row_pos = row_pos + _strict_check(plan, group, all_counts, invalid_per_rank, keep_limit)
    return Layout(row_pos, size_rs[rank], tokens_per_expert, dropped, invalid)


def _send_metadata(plan: Plan, row_pos, dest):
    """send_token [R, T]: slot (d, j) -> token; send_slot [T, R]: token t -> its slot on d."""
    tokens = row_pos.shape[0]
    to_rank = jnp.any(dest[:, :, None] == jnp.arange(plan.num_ranks), axis=1)  # [T, R]
    send_slot = jnp.where(to_rank, jnp.cumsum(to_rank, axis=0, dtype=jnp.int32) - 1, -1)
    send_token = (
        jnp.full((plan.num_ranks, tokens), -1, jnp.int32)
        .at[
            jnp.broadcast_to(jnp.arange(plan.num_ranks), send_slot.shape),
            jnp.where(to_rank, send_slot, tokens),
        ]
        .set(
            jnp.broadcast_to(jnp.arange(tokens, dtype=jnp.int32)[:, None], send_slot.shape),
            mode="drop",
        )
    )
    return send_token, send_slot


def _pack(send_token, x):
    """[R, T, ...]: x[send_token], zero where the slot is empty."""
    return _append_zero_row(x)[jnp.where(send_token >= 0, send_token, x.shape[0])]


def _expand_rows(plan: Plan, recv_rows, row_src):
    """Expert-major rows [C, H] from the received [R, T, H] buffer (zero rows where unfilled)."""
    return _append_zero_row(recv_rows.reshape(-1, recv_rows.shape[-1]))[row_src]


def dispatch(plan: Plan, x, weights, row_pos, dest, rank, group):
    num_ranks, tokens = plan.num_ranks, plan.tokens
    send_token, send_slot = _send_metadata(plan, row_pos, dest)
    here = dest[None, :, :] == jnp.arange(num_ranks)[:, None, None]  # [R, T, K]
    pos_by_rank = jnp.where(here, row_pos[None], -1)
    w_by_rank = jnp.where(here, weights[None], 0.0)
    gather = jnp.where(send_token >= 0, send_token, 0)[:, :, None]
    send_pos = jnp.where(
        (send_token >= 0)[:, :, None], jnp.take_along_axis(pos_by_rank, gather, axis=1), -1
    )
    send_w = jnp.where(
        (send_token >= 0)[:, :, None], jnp.take_along_axis(w_by_rank, gather, axis=1), 0.0
    )
    meta = jnp.concatenate([send_token[:, :, None], send_pos], axis=2)  # [R, T, 1 + K]
    recv_meta = _all_to_all(plan, meta)
    recv_token, recv_row_pos = recv_meta[:, :, 0], recv_meta[:, :, 1:]
    recv_w = _all_to_all(plan, send_w)
    recv_x = _all_to_all(plan, _pack(send_token, x))

    flat_pos = recv_row_pos.reshape(-1)
    target = jnp.where(flat_pos >= 0, flat_pos, plan.rows)
    slot_ids = jnp.repeat(jnp.arange(num_ranks * tokens, dtype=jnp.int32), plan.k)
    row_src = (
        jnp.full(plan.rows, num_ranks * tokens, jnp.int32).at[target].set(slot_ids, mode="drop")
    )
    tokens_out = _expand_rows(plan, recv_x, row_src)
    row_weights = jnp.zeros(plan.rows, jnp.float32).at[target].set(recv_w.reshape(-1), mode="drop")
    handle = Handle(
        row_pos=row_pos,
        dest=dest,
        recv_row_pos=recv_row_pos,
        recv_token=recv_token,
        rank=rank,
        group=group,
        private=(send_token, send_slot, row_src),
        plan=plan,
    )
    return tokens_out, row_weights, handle


def redispatch(handle: Handle, g):
    """Rows [C, H] of g [T, H] along an existing dispatch (combine's VJP)."""
    send_token, _, row_src = handle.private
    return _expand_rows(handle.plan, _all_to_all(handle.plan, _pack(send_token, g)), row_src)


def combine(handle: Handle, y, weights):
    plan = handle.plan
    rows = y.astype(jnp.float32)
    if weights is not None:
        # The barrier keeps XLA from contracting this multiply with the adds below into an FMA,
        # which the host kernels (built with -ffp-contract=off) do not do.
        rows = jax.lax.optimization_barrier(rows * weights[:, None])
    rows = _append_zero_row(rows)
    acc = jnp.zeros((plan.num_ranks, plan.tokens, y.shape[1]), jnp.float32)
    for kk in range(plan.k):  # destination: this rank's rows of each received token, k ascending
        pos = handle.recv_row_pos[:, :, kk]
        acc = jnp.where((pos >= 0)[..., None], acc + rows[jnp.where(pos >= 0, pos, plan.rows)], acc)
    partials = _all_to_all(plan, acc.astype(y.dtype))  # [R (destination), T (slot), H]
    _, send_slot, _ = handle.private

    def add_partial(d, acc):  # source: partials in ascending destination rank
        slot = send_slot[:, d]
        part = partials[d][jnp.maximum(slot, 0)].astype(jnp.float32)
        return jnp.where((slot >= 0)[:, None], acc + part, acc)

    zeros = jnp.zeros((plan.tokens, y.shape[1]), jnp.float32)
    zeros = compat.mark_varying(zeros, compat.varying_axes(partials))
    out = jax.lax.fori_loop(0, plan.num_ranks, add_partial, zeros)
    return out.astype(y.dtype)


def return_row_values(handle: Handle, values):
    """[T, K] float32: values[row] sent back to the (t, k) each row came from; 0 elsewhere."""
    plan = handle.plan
    pos = handle.recv_row_pos
    per_slot = _append_zero_row(values)[jnp.where(pos >= 0, pos, plan.rows)]  # [R, T, K]
    back = _all_to_all(plan, per_slot)  # [R (destination), T (slot), K]
    _, send_slot, _ = handle.private
    dest = jnp.maximum(handle.dest, 0)
    slot = jnp.take_along_axis(send_slot, dest, axis=1)  # [T, K]
    picked = back[dest, jnp.maximum(slot, 0), jnp.arange(plan.k)[None, :]]
    return jnp.where(handle.row_pos >= 0, picked, 0.0)
