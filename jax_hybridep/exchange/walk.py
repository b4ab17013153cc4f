"""THE walk: dispatch goes layout -> levels slow -> fast -> bottom; combine and both VJPs come
back bottom -> levels fast -> slow along the handle's records (docs/design.md §3).

This is the only code that walks levels. Entering level l a rank holds M_l items (M_0 = T, its
tokens), each with per-k metadata (destination EP rank, -1 when that k has no row in this
rank's subtree; destination row; routing weight). Each level step sends an item once to every
peer whose subtree holds one of its rows, carrying only those rows' metadata (§2.1.1); after the
last level (or, for a bottom that spans the fastest level, after the one before) the bottom
expands the items into expert-major rows. Combine returns partial sums per item, added over the
peers of each level in ascending order and rounded to y's dtype as they cross (§2.1.4).
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_hybridep.config import DispatchPlan
from jax_hybridep.exchange.handle import Handle
from jax_hybridep.exchange.steps import Items, RowWeights, Shard, copies_to_others


def dispatch(route, plan: DispatchPlan, x, weights, row_pos, dest, row_end, shard: Shard):
    """(tokens [C, H], FP8 scales or None, row weights [C], Handle) for x [T, H] (or FP8
    (q, scales)) with per-(t, k) weights, rows and destination EP ranks from the layout
    (row_end: this rank's sum(group_sizes))."""
    form = route.wire_form(plan)  # decided once per dispatch
    rows, scales = form.encode(plan, x)  # FP8: quantised once, here at the source
    held = Items(rows, dest, row_pos, weights, scales)
    records = []
    for level, step in enumerate(route.levels):
        held, record = step.send(plan, level, shard, held)
        records.append(record)
    tokens, scales, row_weights, bottom = route.bottom.expand(plan, shard, held, form)
    handle = Handle(row_pos, dest, row_end, shard, tuple(records), bottom, plan, route)
    return tokens, scales, row_weights, handle


def level_rows(handle: Handle):
    """[levels] int32: item copies this shard sent to other ranks at each level (the payload rows
    that crossed that level's links; copies a rank keeps for itself do not count)."""
    plan, shard = handle.plan, handle.shard
    rows = [
        copies_to_others(plan, level, shard.rank, record.send_slot.T >= 0)
        for level, record in enumerate(handle.levels)
    ]
    if handle.route.bottom.spans_level:
        rows.append(handle.route.bottom.copies(plan, shard, handle.bottom))
    return jnp.stack(rows)


def _forward(handle: Handle, g):
    """g [T, H] carried along the recorded levels: what each rank holds at the bottom."""
    steps = zip(handle.route.levels, handle.levels, strict=True)
    for level, (step, record) in enumerate(steps):
        g = step.forward(handle.plan, level, handle.shard, record, g)
    return g


def redispatch(handle: Handle, g):
    """Rows [C, H] of g [T, H] along an existing dispatch (an unweighted combine's VJP)."""
    held = _forward(handle, g)
    return handle.route.bottom.redispatch(handle.plan, handle.shard, handle.bottom, held)


def combine_vjp(handle: Handle, g, y, weights):
    """A weighted combine's VJP: (the rows of g [T, H] times weights [C], rounded to g's dtype;
    the routing-weight gradient [C], weight_grad's order)."""
    held = _forward(handle, g)
    return handle.route.bottom.combine_vjp(
        handle.plan, handle.shard, handle.bottom, held, y, weights
    )


def combine(handle: Handle, y, weights: RowWeights):
    """[T, H] in y's dtype: each token's rows summed in the §2.1.4 order."""
    partials = handle.route.bottom.partials(handle.plan, handle.shard, handle.bottom, y, weights)
    steps = list(zip(handle.route.levels, handle.levels, strict=True))
    for level in reversed(range(len(steps))):
        step, record = steps[level]
        partials = step.reduce(handle.plan, level, handle.shard, record, partials)
    return partials


def return_row_values(handle: Handle, values):
    """[T, K] float32: values [C] of each row sent back to the (t, k) it came from; 0 elsewhere."""
    per_item = handle.route.bottom.row_values(handle.plan, handle.shard, handle.bottom, values)
    steps = list(zip(handle.route.levels, handle.levels, strict=True))
    for level in reversed(range(len(steps))):
        step, record = steps[level]
        per_item = step.pick(handle.plan, level, handle.shard, record, per_item)
    return per_item
