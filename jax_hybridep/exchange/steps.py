"""The interfaces of the walk's steps and what they hand each other (per shard).

Dispatch enters the walk with each token as one item (`Items`: its row and, per k, the
destination EP rank, row and routing weight). A level step sends every held item once to each
peer of its level whose subtree holds one of the item's rows (docs/design.md §2.1.1) and returns the
items the rank holds next, plus a record of how it sent them; the bottom turns the last items
into expert-major rows. Combine and the VJPs come back through the records, fast -> slow.

Records are registered pytree dataclasses with named fields: one class per step kind, all
level records carrying `send_slot` and `held_dest` (what every kind's `pick` and the traffic
count need).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import jax
import jax.numpy as jnp

from jax_hybridep.config import DispatchPlan


def pytree_record(cls):
    """Registers a dataclass whose fields are all arrays (or pytrees of them) as a pytree."""
    names = [f.name for f in dataclasses.fields(cls)]
    return jax.tree_util.register_dataclass(cls, data_fields=names, meta_fields=[])


@pytree_record
@dataclasses.dataclass(frozen=True)
class Shard:
    """Who this shard is: its EP rank and EP-group id (int32 scalars, from `axis_index`)."""

    rank: jax.Array
    group: jax.Array


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

    def expand(self, plan: DispatchPlan, shard: Shard, held: Items):
        """(tokens [C, H], scales, row weights [C], the bottom's record). With FP8 on the wire
        the tokens are dequantised to plan.row_dtype and scales is None, or, with fp8_rows, the
        tokens are the e4m3fn payload and scales [C, nb] float32; otherwise scales is None."""

    def redispatch(self, plan: DispatchPlan, shard: Shard, record, g):
        """Rows [C, H] of the held g [M, H] along the dispatch (combine's VJP)."""

    def combine_vjp(self, plan: DispatchPlan, shard: Shard, record, g, y, weights):
        """A weighted combine's VJP from the held g: (rows * weights rounded to g's dtype,
        weight_grad.row_dot of y and the rows)."""

    def partials(self, plan: DispatchPlan, shard: Shard, record, y, weights):
        """[M, H] in y's dtype: per held item its rows summed in ascending k in float32
        (times `weights` unless None), over the spanned level when there is one."""

    def row_values(self, plan: DispatchPlan, shard: Shard, record, values):
        """[M, K] float32: values [C] of each row returned to its held (item, k); 0 elsewhere."""

    def copies(self, plan: DispatchPlan, shard: Shard, record):
        """[] int32: item copies sent to other ranks over the spanned level (spans_level only)."""


# ----------------------------------------------------------------------------- level geometry


def level_peer(plan: DispatchPlan, level: int, shard: Shard):
    """This rank's coordinate in `level` and an id of its level group (the ranks differing from it
    only in that coordinate): the rendezvous and the GPU windows are keyed by it."""
    size, stride = plan.topology.level_sizes[level], plan.topology.level_strides[level]
    coord = (shard.rank // stride) % size
    return coord, shard.group * plan.ep_size + (shard.rank - coord * stride)


def copies_to_others(plan: DispatchPlan, level: int, rank, sent):
    """Copies a shard sent to other ranks at `level`; sent: [S, ...] bool, per peer first."""
    size, stride = plan.topology.level_sizes[level], plan.topology.level_strides[level]
    others = jnp.arange(size) != (rank // stride) % size
    return jnp.sum(sent & others.reshape((size,) + (1,) * (sent.ndim - 1)), dtype=jnp.int32)


@dataclasses.dataclass(frozen=True)
class FastLevel:
    """The fastest level, as a bottom that spans it sees it from one rank."""

    level: int  # index in the topology (the last)
    size: int  # ranks in the level group
    coord: jax.Array  # this rank's coordinate in it
    group: jax.Array  # the level group's id


def fast_level(plan: DispatchPlan, shard: Shard) -> FastLevel:
    last = len(plan.topology.levels) - 1
    coord, level_group = level_peer(plan, last, shard)
    return FastLevel(last, plan.topology.level_sizes[last], coord, level_group)


def fast_dest(fast: FastLevel, held_dest):
    """[M, K]: each held destination's coordinate in the fastest level (stride 1); -1 kept."""
    return jnp.where(held_dest >= 0, held_dest % fast.size, -1)


def span_copies(fast: FastLevel, dest):
    """[] int32: (item, peer) pairs with a row on another rank of the level; dest in coordinates."""
    peers = jnp.arange(fast.size)
    to_peer = jnp.any(dest[:, :, None] == peers, axis=1) & (peers != fast.coord)
    return jnp.sum(to_peer, dtype=jnp.int32)


class SpanningBottom:
    """What every bottom spanning the fastest level shares: `spans_level`, and the level's copies
    counted from its record's `dest` ([M, K] int32, each held (item, k)'s coordinate in the level,
    -1 for none)."""

    spans_level = True

    def copies(self, plan: DispatchPlan, shard: Shard, record):
        return span_copies(fast_level(plan, shard), record.dest)
