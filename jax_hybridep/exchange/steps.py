"""The interfaces of the walk's steps and what they hand each other (per shard).

Dispatch enters the walk with each token as one item (`Items`: its row and, per k, the
destination EP rank, row and routing weight). A level step sends every held item once to each
peer of its level whose subtree holds one of the item's rows (docs/design.md §2.1.1) and returns the
items the rank holds next, plus a record of how it sent them; the bottom turns the last items
into expert-major rows. Combine and the VJPs come back through the records, fast -> slow.

Records are pytree dataclasses with named fields (`jax_hybridep.pytree.pytree_record`): one class
per step kind, all level records carrying `send_slot` and `held_dest` (what every kind's `pick`
and the traffic count need). What every step is handed is computed once per call and carried:
the `Shard` (EP rank, group, its place in the fastest level) and combine's `RowWeights`. The
helpers at the end are the ones more than one step kind uses.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Protocol

import jax
import jax.numpy as jnp

from jax_hybridep.config import DispatchPlan
from jax_hybridep.pytree import pytree_record, static_field

if TYPE_CHECKING:
    from jax_hybridep.exchange.wire import WireForm


@pytree_record
@dataclasses.dataclass(frozen=True)
class FastLevel:
    """The fastest level as one rank sees it (what a bottom spanning it needs)."""

    level: int = static_field()  # index in the topology (the last)
    size: int = static_field()  # ranks in the level group
    coord: jax.Array  # this rank's coordinate in it
    group: jax.Array  # the level group's id


@pytree_record
@dataclasses.dataclass(frozen=True)
class Shard:
    """Who this shard is, computed once per dispatch and carried in the handle: its EP rank and
    EP-group id (int32 scalars, from `axis_index`) and its place in the fastest level."""

    rank: jax.Array
    group: jax.Array
    fast: FastLevel

    @classmethod
    def of(cls, plan: DispatchPlan, rank, group) -> Shard:
        last = len(plan.topology.levels) - 1
        coord, level_group = _level_peer(plan, last, rank, group)
        return cls(
            rank, group, FastLevel(last, plan.topology.level_sizes[last], coord, level_group)
        )


@pytree_record
@dataclasses.dataclass(frozen=True)
class RowWeights:
    """Combine's per-row weights as every bottom takes them: [C] float32, and whether the
    combine is weighted (a static flag; unweighted, the values are zeros the handlers ignore,
    made here once: `unweighted`)."""

    values: jax.Array
    weighted: bool = static_field()

    @classmethod
    def unweighted(cls, plan: DispatchPlan) -> RowWeights:
        return cls(jnp.zeros((plan.rows,), jnp.float32), False)


@pytree_record
@dataclasses.dataclass(frozen=True)
class Items:
    """Items a rank holds between levels: M rows, each with K routing slots."""

    rows: jax.Array  # [M, H] (FP8 wire: the payload, or whole wire rows; exchange/wire.py)
    dest: jax.Array  # [M, K] int32: destination EP rank of each k (-1: none in this subtree)
    pos: jax.Array  # [M, K] int32: destination row of each k (-1: none)
    weights: jax.Array  # [M, K] float32: routing weight of each k
    scales: jax.Array | None = None  # [M, nb] float32: FP8 block scales travelling beside rows


@pytree_record
@dataclasses.dataclass(frozen=True)
class Layout:
    """What the layout step gives every (t, k) (per shard)."""

    row_pos: jax.Array  # [T, K] int32: destination row, -1 when invalid or dropped
    dest: jax.Array  # [T, K] int32: destination EP rank of each kept (t, k), -1 otherwise
    group_sizes: jax.Array  # [L] int32: rows per local slot of this rank
    tokens_per_expert: jax.Array  # [E] int32: over the EP group, before drops
    dropped: jax.Array  # [] int32: this shard's rows dropped over capacity
    invalid: jax.Array  # [] int32: this shard's invalid expert ids


@dataclasses.dataclass(frozen=True)
class LevelRecord:
    """What every level step records: item -> its slot on each peer, and the held destinations."""

    send_slot: jax.Array  # [M, S] int32: slot of item m in the block for peer p, -1 if not sent
    held_dest: jax.Array  # [M, K] int32: the items' destination EP ranks when they were sent


class LayoutStep(Protocol):
    def __call__(self, plan: DispatchPlan, topk_idx, shard: Shard) -> Layout: ...


class LevelStep(Protocol):
    """One kind of level: how items cross it, and how combine's values come back over it."""

    sends: str  # how it crosses: "padded", "ragged" or "copies" (jax_hybridep/level_traffic.py)

    def send(self, plan: DispatchPlan, level: int, shard: Shard, held: Items):
        """(the items held after the level, its LevelRecord)."""

    def forward(self, plan: DispatchPlan, level: int, shard: Shard, record, g):
        """Rows g [M, H] carried along a recorded send: [S * M, H]."""

    def reduce(self, plan: DispatchPlan, level: int, shard: Shard, record, partials):
        """Partials [S * M, H] of the items after the level, added back per held item over the
        peers in ascending order in float32, rounded to their dtype: [M, H]."""

    def pick(self, plan: DispatchPlan, level: int, shard: Shard, record, values):
        """Per-(item, k) float32 values [S * M, K] after the level, returned to the held
        (item, k) from the peer holding that row: [M, K]."""


class Bottom(Protocol):
    """Where the walk ends: the held items become expert-major rows and combine starts.

    `spans_level`: whether the bottom itself crosses the fastest level (the walk then stops one
    level early and the bottom counts that level's copies).
    """

    spans_level: bool

    def unsupported_reason(self, plan: DispatchPlan, form: WireForm) -> str | None:
        """Why this bottom cannot serve the plan with its tokens travelling as `form` (route
        selection asks, before tracing anything), or None."""

    def expand(self, plan: DispatchPlan, shard: Shard, held: Items, form: WireForm):
        """(tokens [C, H], scales, row weights [C], the bottom's record); `form` says how the held
        rows travel (exchange/wire.py). With FP8 on the wire the tokens are dequantised to
        plan.row_dtype and scales is None, or, with fp8_rows, the tokens are the e4m3fn payload
        and scales [C, nb] float32; otherwise scales is None."""

    def redispatch(self, plan: DispatchPlan, shard: Shard, record, g):
        """Rows [C, H] of the held g [M, H] along the dispatch (combine's VJP)."""

    def combine_vjp(self, plan: DispatchPlan, shard: Shard, record, g, y, weights):
        """A weighted combine's VJP from the held g: (rows * weights rounded to g's dtype,
        weight_grad.row_dot of y and the rows)."""

    def partials(self, plan: DispatchPlan, shard: Shard, record, y, weights: RowWeights):
        """[M, H] in y's dtype: per held item its rows summed in ascending k in float32
        (times the weights when weighted), over the spanned level when there is one."""

    def row_values(self, plan: DispatchPlan, shard: Shard, record, values):
        """[M, K] float32: values [C] of each row returned to its held (item, k); 0 elsewhere."""

    def copies(self, plan: DispatchPlan, shard: Shard, record):
        """[] int32: item copies sent to other ranks over the spanned level (spans_level only)."""


# ----------------------------------------------------------------------------- level geometry


def _level_peer(plan: DispatchPlan, level: int, rank, group):
    size, stride = plan.topology.level_sizes[level], plan.topology.level_strides[level]
    coord = (rank // stride) % size
    return coord, group * plan.ep_size + (rank - coord * stride)


def level_peer(plan: DispatchPlan, level: int, shard: Shard):
    """This rank's coordinate in `level` and an id of its level group (the ranks differing from it
    only in that coordinate): the rendezvous and the GPU windows are keyed by it."""
    return _level_peer(plan, level, shard.rank, shard.group)


def copies_to_others(plan: DispatchPlan, level: int, rank, sent):
    """Copies a shard sent to other ranks at `level`; sent: [S, ...] bool, per peer first."""
    size, stride = plan.topology.level_sizes[level], plan.topology.level_strides[level]
    others = jnp.arange(size) != (rank // stride) % size
    return jnp.sum(sent & others.reshape((size,) + (1,) * (sent.ndim - 1)), dtype=jnp.int32)


def fast_dest(fast: FastLevel, held_dest):
    """[M, K]: each held destination's coordinate in the fastest level (stride 1); -1 kept."""
    return jnp.where(held_dest >= 0, held_dest % fast.size, -1)


def span_copies(fast: FastLevel, dest):
    """[] int32: (item, peer) pairs with a row on another rank of the level; dest in coordinates."""
    peers = jnp.arange(fast.size)
    to_peer = jnp.any(dest[:, :, None] == peers, axis=1) & (peers != fast.coord)
    return jnp.sum(to_peer, dtype=jnp.int32)


class SpanningBottom:
    """What every bottom spanning the fastest level shares: `spans_level`, no plan it refuses by
    default, and the level's copies counted from its record's `dest` ([M, K] int32, each held
    (item, k)'s coordinate in the level, -1 for none)."""

    spans_level = True

    def unsupported_reason(self, plan: DispatchPlan, form: WireForm) -> str | None:
        return None

    def copies(self, plan: DispatchPlan, shard: Shard, record):
        return span_copies(shard.fast, record.dest)


# ----------------------------------------------------------------------------- shared by steps


def append_zero_row(x):
    """x with one zero row appended: index len(x) then reads zeros (gathers of 'no row')."""
    return jnp.concatenate([x, jnp.zeros((1,) + x.shape[1:], x.dtype)])


def level_all_to_all(plan: DispatchPlan, level: int, x):
    """Tiled all_to_all over one level's axes: chunk p of axis 0 goes to peer p."""
    return jax.lax.all_to_all(x, plan.topology.levels[level], 0, 0, tiled=True)


def item_row_values(plan: DispatchPlan, held_pos, values):
    """[M, K] float32: values [C] of each held (item, k)'s row; 0 where it has none."""
    return append_zero_row(values)[jnp.where(held_pos >= 0, held_pos, plan.rows)]
