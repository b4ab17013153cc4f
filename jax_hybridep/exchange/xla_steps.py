"""Pure-JAX steps: the `xla` backend's, and the oracle every other step kind is tested against.

A level packs one copy per (item, destination peer) into a static [S, M, ...] buffer, compacted
in ascending item order, and exchanges it with a tiled `jax.lax.all_to_all` over the level's mesh
axes; the S * M received items are the next level's. The rows bottom expands the last items into
expert-major rows with jnp gathers. Combine writes its float32 adds out one by one in the §2.1
order (k ascending at the destination, then peers ascending at each level), so the host and CUDA
handlers can match it bitwise.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from jax_hybridep import compat, fp8, weight_grad
from jax_hybridep.config import DispatchPlan
from jax_hybridep.exchange.steps import (
    Items,
    LevelRecord,
    RowWeights,
    Shard,
    append_zero_row,
    item_row_values,
    level_all_to_all,
)
from jax_hybridep.exchange.wire import WireForm
from jax_hybridep.pytree import pytree_record

# ----------------------------------------------------------------------------- level


def _level_sends(plan: DispatchPlan, level: int, held_dest):
    """For held items [M] with destinations [M, K]: their peer per k and their send slots.

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
    packed = append_zero_row(x)[jnp.where(send_item >= 0, send_item, x.shape[0])]
    return packed.reshape((-1,) + x.shape[1:])


def _pack_metadata(send_item, coord, values, fill):
    """[S * M, K]: each sent item's values for the k whose destination is that peer, else fill."""
    size = send_item.shape[0]
    here = coord[None, :, :] == jnp.arange(size)[:, None, None]  # [S, M, K]
    per_peer = jnp.where(here, values[None], fill)
    picked = jnp.take_along_axis(per_peer, jnp.maximum(send_item, 0)[:, :, None], axis=1)
    return jnp.where((send_item >= 0)[:, :, None], picked, fill).reshape(-1, values.shape[1])


@pytree_record
@dataclasses.dataclass(frozen=True)
class XlaLevelRecord(LevelRecord):
    send_item: jax.Array  # [S, M] int32: slot (p, j) -> the item it carries, -1 for empty


@dataclasses.dataclass(frozen=True)
class XlaLevel:
    """A level crossed by jnp packing and `jax.lax.all_to_all` (NCCL on GPUs, gloo or in-process
    copies on CPU)."""

    sends: ClassVar[str] = "padded"  # what crosses the level (jax_hybridep/level_traffic.py)

    def send(self, plan: DispatchPlan, level: int, shard: Shard, held: Items):
        k = plan.k
        coord, send_item, send_slot = _level_sends(plan, level, held.dest)
        meta = jnp.concatenate(
            [
                _pack_metadata(send_item, coord, held.dest, -1),
                _pack_metadata(send_item, coord, held.pos, -1),
            ],
            axis=1,
        )
        meta = level_all_to_all(plan, level, meta)
        weights = level_all_to_all(plan, level, _pack_metadata(send_item, coord, held.weights, 0.0))
        rows = level_all_to_all(plan, level, _pack(send_item, held.rows))
        scales = None  # FP8 block scales travel beside their payload rows
        if held.scales is not None:
            scales = level_all_to_all(plan, level, _pack(send_item, held.scales))
        nxt = Items(rows, meta[:, :k], meta[:, k:], weights, scales)
        return nxt, XlaLevelRecord(send_slot, held.dest, send_item)

    def forward(self, plan: DispatchPlan, level: int, shard: Shard, record: XlaLevelRecord, g):
        return level_all_to_all(plan, level, _pack(record.send_item, g))

    def reduce(
        self, plan: DispatchPlan, level: int, shard: Shard, record: XlaLevelRecord, partials
    ):
        size, send_slot = plan.topology.level_sizes[level], record.send_slot
        back = level_all_to_all(plan, level, partials).reshape(size, -1, partials.shape[-1])

        def add_partial(p, acc):
            slot = send_slot[:, p]
            part = back[p][jnp.maximum(slot, 0)].astype(jnp.float32)
            return jnp.where((slot >= 0)[:, None], acc + part, acc)

        zeros = jnp.zeros((send_slot.shape[0], partials.shape[-1]), jnp.float32)
        zeros = compat.mark_varying(zeros, compat.varying_axes(back))
        return jax.lax.fori_loop(0, size, add_partial, zeros).astype(partials.dtype)

    def pick(self, plan: DispatchPlan, level: int, shard: Shard, record: XlaLevelRecord, values):
        size, stride = plan.topology.level_sizes[level], plan.topology.level_strides[level]
        back = level_all_to_all(plan, level, values).reshape(size, -1, plan.k)
        held_dest = record.held_dest
        coord = jnp.where(held_dest >= 0, (held_dest // stride) % size, 0)
        slot = jnp.maximum(jnp.take_along_axis(record.send_slot, coord, axis=1), 0)
        picked = back[coord, slot, jnp.arange(plan.k)[None, :]]
        return jnp.where(held_dest >= 0, picked, 0.0)


# ----------------------------------------------------------------------------- bottom


@pytree_record
@dataclasses.dataclass(frozen=True)
class XlaRowsRecord:
    held_pos: jax.Array  # [M, K] int32: each held (item, k)'s row, -1 for none
    row_src: jax.Array  # [C] int32: the held item each row copies, M for none


@dataclasses.dataclass(frozen=True)
class XlaRows:
    """Expert-major rows gathered from the held items with jnp."""

    spans_level = False

    def unsupported_reason(self, plan: DispatchPlan, form: WireForm) -> str | None:
        return None

    def expand(self, plan: DispatchPlan, shard: Shard, held: Items, form: WireForm):
        flat_pos = held.pos.reshape(-1)
        target = jnp.where(flat_pos >= 0, flat_pos, plan.rows)
        items = held.pos.shape[0]
        item_ids = jnp.repeat(jnp.arange(items, dtype=jnp.int32), plan.k)
        row_src = jnp.full(plan.rows, items, jnp.int32).at[target].set(item_ids, mode="drop")
        tokens, scales = append_zero_row(held.rows)[row_src], None
        if held.scales is not None:  # FP8 on the wire: the payload's bytes and the scales
            tokens = jax.lax.bitcast_convert_type(tokens, jnp.float8_e4m3fn)
            scales = append_zero_row(held.scales)[row_src]
            if not form.fp8_rows:
                tokens, scales = fp8.dequantize(tokens, scales, plan.row_dtype), None
        row_weights = (
            jnp.zeros(plan.rows, jnp.float32).at[target].set(held.weights.reshape(-1), mode="drop")
        )
        return tokens, scales, row_weights, XlaRowsRecord(held.pos, row_src)

    def redispatch(self, plan: DispatchPlan, shard: Shard, record: XlaRowsRecord, g):
        return append_zero_row(g)[record.row_src]

    def combine_vjp(self, plan: DispatchPlan, shard: Shard, record: XlaRowsRecord, g, y, weights):
        rows = self.redispatch(plan, shard, record, g)
        scaled = (rows.astype(jnp.float32) * weights[:, None]).astype(rows.dtype)
        return scaled, weight_grad.row_dot(plan.topology.platform, y, rows)

    def partials(
        self, plan: DispatchPlan, shard: Shard, record: XlaRowsRecord, y, weights: RowWeights
    ):
        rows = y.astype(jnp.float32)
        if weights.weighted:
            # The barrier keeps XLA from contracting this multiply with the adds below into an
            # FMA, which the host kernels (built with -ffp-contract=off) do not do.
            rows = jax.lax.optimization_barrier(rows * weights.values[:, None])
        rows = append_zero_row(rows)
        held_pos = record.held_pos
        acc = jnp.zeros((held_pos.shape[0], y.shape[1]), jnp.float32)
        for kk in range(plan.k):  # this rank's rows of each held item, k ascending
            pos = held_pos[:, kk]
            acc = jnp.where(
                (pos >= 0)[:, None], acc + rows[jnp.where(pos >= 0, pos, plan.rows)], acc
            )
        return acc.astype(y.dtype)

    def row_values(self, plan: DispatchPlan, shard: Shard, record: XlaRowsRecord, values):
        return item_row_values(plan, record.held_pos, values)
