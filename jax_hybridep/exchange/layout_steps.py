"""Layout steps: every (t, k) gets its destination row before anything moves (docs/design.md
§2.1.2-3).

All of them all-gather per-(source rank, expert) counts over the EP group, so every sender knows
its drops without a sync with the Python process, and plan the groups the same way: the jnp
layout (the oracle), the host handler that gathers through the process-wide rendezvous, the host
handler over counts an XLA all-gather brought across processes, and the CUDA layout kernels over
an XLA all-gather.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_hybridep import compat, errors
from jax_hybridep.config import DispatchPlan
from jax_hybridep.errors import StrictModeError, strict_mode_message
from jax_hybridep.exchange.ffi_call import call, exchange_attrs, i32, layout_attrs
from jax_hybridep.exchange.steps import Layout, Shard


def gather_counts(plan: DispatchPlan, topk_idx):
    """This shard's rows per expert [E], invalid ids [], and every rank's both, all-gathered over
    the EP group as [R, E + 1] (E per-expert counts, then the invalid count)."""
    num_experts = plan.num_experts
    valid = (topk_idx >= 0) & (topk_idx < num_experts)
    expert = jnp.where(valid, topk_idx, num_experts).reshape(-1)  # invalid -> sentinel E
    counts = jnp.zeros(num_experts + 1, jnp.int32).at[expert].add(1)[:num_experts]
    invalid = jnp.sum((topk_idx != -1) & ~valid, dtype=jnp.int32)
    gathered = jax.lax.all_gather(jnp.concatenate([counts, invalid[None]]), plan.topology.ep_axes)
    return counts, invalid, gathered


def _layout(
    plan: DispatchPlan, topk_idx, row_pos, group_sizes, tokens_per_expert, dropped, invalid
) -> Layout:
    """The Layout, with each kept (t, k)'s destination EP rank from the placement."""
    expert_rank = jnp.asarray(np.asarray(plan.expert_rank, np.int32))
    dest = jnp.where(row_pos >= 0, expert_rank[jnp.clip(topk_idx, 0, plan.num_experts - 1)], -1)
    return Layout(row_pos, dest, group_sizes, tokens_per_expert, dropped.astype(jnp.int32), invalid)


def _layout_types(plan: DispatchPlan, topk_idx, dropped_dtype=jnp.int32):
    return (
        i32(topk_idx.shape),
        i32((plan.num_slots,)),
        i32((plan.num_experts,)),
        jax.ShapeDtypeStruct((), dropped_dtype),
        i32(()),
    )


# ----------------------------------------------------------------------------- jnp


def _plan_groups(plan: DispatchPlan, totals):
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

    zeros = compat.mark_varying(jnp.zeros(plan.ep_size, jnp.int32), compat.varying_axes(rows))
    _, (kept, offset, size) = jax.lax.scan(step, zeros, rows.T)
    return kept.T, offset.T, size.T  # each [R, L]


def _strict_check(group, all_counts, invalid_per_rank, keep_limit):
    """Raises (through a Python callback) the same error the host layout handler returns."""
    before = jnp.cumsum(all_counts, axis=0, dtype=jnp.int32) - all_counts
    kept = jnp.clip(keep_limit[None, :] - before, 0, all_counts)
    dropped_per_rank = jnp.sum(all_counts - kept, axis=1, dtype=jnp.int32)

    def check(group, dropped, invalid):
        if int(np.sum(dropped)) + int(np.sum(invalid)) > 0:
            error = StrictModeError(strict_mode_message(int(group), dropped, invalid))
            errors.record(error)  # check_errors() raises it with its type (JAX does not)
            raise error
        return np.int32(0)

    return jax.pure_callback(
        check, jax.ShapeDtypeStruct((), jnp.int32), group, dropped_per_rank, invalid_per_rank
    )


@dataclasses.dataclass(frozen=True)
class JnpLayout:
    """The layout in jnp: counts by an XLA all-gather, rows by a stable sort per expert."""

    def __call__(self, plan: DispatchPlan, topk_idx, shard: Shard) -> Layout:
        num_experts, (tokens, k) = plan.num_experts, topk_idx.shape
        valid = (topk_idx >= 0) & (topk_idx < num_experts)
        expert = jnp.where(valid, topk_idx, num_experts).reshape(-1)  # invalid -> sentinel E
        counts, invalid, gathered = gather_counts(plan, topk_idx)
        all_counts, invalid_per_rank = gathered[:, :num_experts], gathered[:, num_experts]
        tokens_per_expert = jnp.sum(all_counts, axis=0, dtype=jnp.int32)

        kept_rs, offset_rs, size_rs = _plan_groups(plan, tokens_per_expert)
        er, es = np.asarray(plan.expert_rank), np.asarray(plan.expert_slot)
        keep_limit, group_offset = kept_rs[er, es], offset_rs[er, es]  # [E]

        # Index of each row within its expert, in (source rank, t, k) order: rows from lower
        # source ranks, then this rank's earlier rows of the same expert (a stable sort by expert).
        before = (jnp.cumsum(all_counts, axis=0, dtype=jnp.int32) - all_counts)[shard.rank]
        order = jnp.argsort(expert, stable=True)
        starts = jnp.cumsum(counts, dtype=jnp.int32) - counts
        starts = jnp.concatenate([starts, jnp.zeros(1, jnp.int32)])
        rank_sorted = jnp.arange(tokens * k, dtype=jnp.int32) - starts[expert[order]]
        local_index = jnp.zeros(tokens * k, jnp.int32).at[order].set(rank_sorted)
        safe = jnp.minimum(expert, num_experts - 1)
        index = before[safe] + local_index
        kept = valid.reshape(-1) & (index < keep_limit[safe])
        row_pos = jnp.where(kept, group_offset[safe] + index, -1).reshape(tokens, k)
        dropped = jnp.sum(valid.reshape(-1) & ~kept, dtype=jnp.int32)
        if plan.config.strict:
            # Adding the check's zero to row_pos, which every later step reads, keeps it from
            # being dead-code eliminated.
            row_pos = row_pos + _strict_check(shard.group, all_counts, invalid_per_rank, keep_limit)
        return _layout(
            plan, topk_idx, row_pos, size_rs[shard.rank], tokens_per_expert, dropped, invalid
        )


# ----------------------------------------------------------------------------- host


@dataclasses.dataclass(frozen=True)
class HostLayout:
    """The host handler; the counts are all-gathered through the process-wide rendezvous."""

    def __call__(self, plan: DispatchPlan, topk_idx, shard: Shard) -> Layout:
        return _layout(
            plan,
            topk_idx,
            *call(
                "layout",
                _layout_types(plan, topk_idx),
                topk_idx,
                shard.rank,
                shard.group,
                like=(topk_idx,),
                plan=plan,
                **layout_attrs(plan) | exchange_attrs(plan, plan.ep_size),
            ),
        )


@dataclasses.dataclass(frozen=True)
class HostGatheredLayout:
    """The host handler over counts an XLA all-gather brought (EP groups across processes)."""

    def __call__(self, plan: DispatchPlan, topk_idx, shard: Shard) -> Layout:
        _, _, gathered = gather_counts(plan, topk_idx)
        return _layout(
            plan,
            topk_idx,
            *call(
                "layout_gathered",
                _layout_types(plan, topk_idx),
                topk_idx,
                gathered,
                shard.rank,
                shard.group,
                like=(topk_idx, gathered),
                plan=plan,
                **layout_attrs(plan),
            ),
        )


# ----------------------------------------------------------------------------- CUDA


@dataclasses.dataclass(frozen=True)
class CudaLayout:
    """The CUDA layout kernels over counts an XLA all-gather (NCCL) brought."""

    def __call__(self, plan: DispatchPlan, topk_idx, shard: Shard) -> Layout:
        _, _, gathered = gather_counts(plan, topk_idx)
        return _layout(
            plan,
            topk_idx,
            *call(
                "cuda_layout",
                _layout_types(plan, topk_idx, jnp.int64),
                topk_idx,
                gathered,
                shard.rank,
                shard.group,
                like=(topk_idx, gathered),
                plan=plan,
                **layout_attrs(plan),
            ),
        )
