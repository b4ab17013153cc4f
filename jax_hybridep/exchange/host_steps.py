"""Host (CPU) steps over the C++ handlers of xla_ffi/cpu/handlers/level_handlers.cc.

A level whose ranks share this process is crossed by direct write: the ranks meet in a
process-wide rendezvous (keyed by execution, call site, level group and generation; docs/design.md
§2.1.7), each writes its item copies straight into its peers' next-level buffers, and combine's
partials are read in place from the peers. A level that crosses processes is packed by a handler
and exchanged with an XLA all-to-all. The rows bottom expands the last items with a handler that
also fuses combine's VJP (the routing-weight dot in weight_grad's order, the rows never stored).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jax_hybridep.config import DispatchPlan
from jax_hybridep.exchange.ffi_call import call, exchange_attrs, i32, row_attrs
from jax_hybridep.exchange.steps import (
    Items,
    LevelRecord,
    RowWeights,
    Shard,
    item_row_values,
    level_all_to_all,
    level_peer,
)
from jax_hybridep.exchange.wire import PLAIN, WireForm
from jax_hybridep.pytree import pytree_record


@pytree_record
@dataclasses.dataclass(frozen=True)
class HostLevelRecord(LevelRecord):
    held_pos: jax.Array  # [M, K] int32: the items' destination rows when they were sent


def _send_types(plan: DispatchPlan, level: int, held: Items):
    """Output types of a level's send: the next items [S * M, ...] and send_slot [M, S]."""
    size = plan.topology.level_sizes[level]
    items, k = held.dest.shape
    return (
        jax.ShapeDtypeStruct((size * items, held.rows.shape[1]), held.rows.dtype),
        i32((size * items, k)),
        i32((size * items, k)),
        jax.ShapeDtypeStruct((size * items, k), jnp.float32),
        i32((items, size)),
    )


def _level_attrs(plan: DispatchPlan, level: int) -> dict:
    return dict(
        num_ranks=np.int64(plan.topology.level_sizes[level]),
        stride=np.int64(plan.topology.level_strides[level]),
    )


class _HostLevel:
    """The steps both host level kinds share; `_send` and `_all_to_all` cross the level."""

    def _send(self, plan: DispatchPlan, level: int, shard: Shard, held: Items):
        """(the next items, send_slot [M, S])."""
        raise NotImplementedError

    def _all_to_all(self, plan: DispatchPlan, level: int, shard: Shard, data):
        """Block p of data [S * n, ...] to peer p."""
        raise NotImplementedError

    def send(self, plan: DispatchPlan, level: int, shard: Shard, held: Items):
        nxt, send_slot = self._send(plan, level, shard, held)
        return nxt, HostLevelRecord(send_slot, held.dest, held.pos)

    def forward(self, plan: DispatchPlan, level: int, shard: Shard, record: HostLevelRecord, g):
        ignored = jnp.zeros(record.held_dest.shape, jnp.float32)  # no routing weights wanted
        nxt, _ = self._send(
            plan, level, shard, Items(g, record.held_dest, record.held_pos, ignored)
        )
        return nxt.rows

    def pick(self, plan: DispatchPlan, level: int, shard: Shard, record: HostLevelRecord, values):
        back = self._all_to_all(plan, level, shard, values)
        held_dest = record.held_dest
        return call(
            "level_pick",
            jax.ShapeDtypeStruct(held_dest.shape, jnp.float32),
            back,
            record.send_slot,
            held_dest,
            like=(back, held_dest),
            plan=plan,
            stride=np.int64(plan.topology.level_strides[level]),
        )


@dataclasses.dataclass(frozen=True)
class HostDirectLevel(_HostLevel):
    """A level whose ranks share this process: item copies written straight into the peers."""

    sends: ClassVar[str] = "copies"  # what crosses the level (jax_hybridep/level_traffic.py)

    def _send(self, plan: DispatchPlan, level: int, shard: Shard, held: Items):
        coord, level_group = level_peer(plan, level, shard)
        *nxt, send_slot = call(
            "level_send",
            _send_types(plan, level, held),
            held.rows,
            held.dest,
            held.pos,
            held.weights,
            coord,
            level_group,
            like=(held.rows, held.dest, held.pos, held.weights),
            plan=plan,
            **exchange_attrs(plan, plan.topology.level_sizes[level]),
            stride=np.int64(plan.topology.level_strides[level]),
        )
        return Items(*nxt), send_slot

    def _all_to_all(self, plan: DispatchPlan, level: int, shard: Shard, data):
        coord, level_group = level_peer(plan, level, shard)
        return call(
            "blocks_all_to_all",
            jax.ShapeDtypeStruct(data.shape, data.dtype),
            data,
            coord,
            level_group,
            like=(data,),
            plan=plan,
            **exchange_attrs(plan, plan.topology.level_sizes[level]),
        )

    def reduce(
        self, plan: DispatchPlan, level: int, shard: Shard, record: HostLevelRecord, partials
    ):
        # Each rank reads its peers' partials in place.
        coord, level_group = level_peer(plan, level, shard)
        send_slot = record.send_slot
        out_type = jax.ShapeDtypeStruct((send_slot.shape[0], partials.shape[1]), partials.dtype)
        return call(
            "level_reduce_pull",
            out_type,
            partials,
            send_slot,
            coord,
            level_group,
            like=(partials, send_slot),
            plan=plan,
            **exchange_attrs(plan, plan.topology.level_sizes[level]),
        )


@dataclasses.dataclass(frozen=True)
class HostPackedLevel(_HostLevel):
    """A level that crosses processes: packed by a handler around an XLA all-to-all."""

    sends: ClassVar[str] = "padded"  # what crosses the level (jax_hybridep/level_traffic.py)

    def _send(self, plan: DispatchPlan, level: int, shard: Shard, held: Items):
        *packed, send_slot = call(
            "level_pack",
            _send_types(plan, level, held),
            held.rows,
            held.dest,
            held.pos,
            held.weights,
            like=(held.rows, held.dest, held.pos, held.weights),
            plan=plan,
            **_level_attrs(plan, level),
        )
        return Items(*(level_all_to_all(plan, level, a) for a in packed)), send_slot

    def _all_to_all(self, plan: DispatchPlan, level: int, shard: Shard, data):
        return level_all_to_all(plan, level, data)

    def reduce(
        self, plan: DispatchPlan, level: int, shard: Shard, record: HostLevelRecord, partials
    ):
        back = level_all_to_all(plan, level, partials)
        send_slot = record.send_slot
        out_type = jax.ShapeDtypeStruct((send_slot.shape[0], partials.shape[1]), partials.dtype)
        return call("level_reduce", out_type, back, send_slot, like=(back, send_slot), plan=plan)


# ----------------------------------------------------------------------------- bottom


@pytree_record
@dataclasses.dataclass(frozen=True)
class HostRowsRecord:
    held_pos: jax.Array  # [M, K] int32: each held (item, k)'s row, -1 for none


def _row_types(plan: DispatchPlan, rows):
    return (
        jax.ShapeDtypeStruct((plan.rows, rows.shape[1]), rows.dtype),
        jax.ShapeDtypeStruct((plan.rows,), jnp.float32),
    )


def _expand_items(plan: DispatchPlan, rows, pos, weights, form: WireForm):
    """(tokens [C, ...], row weights [C]) from held rows [M, ...] and their rows/weights [M, K]
    (FP8 wire rows dequantised on the way unless fp8_rows: exchange/wire.py)."""
    out_types = (form.handler_rows(plan, rows), jax.ShapeDtypeStruct((plan.rows,), jnp.float32))
    return call(
        "expand_items",
        out_types,
        rows,
        pos,
        weights,
        like=(rows, pos),
        plan=plan,
        **row_attrs(plan, form.fp8_hidden),
    )


@dataclasses.dataclass(frozen=True)
class HostRows:
    """Expert-major rows written from the held items by a handler."""

    spans_level = False

    def unsupported_reason(self, plan: DispatchPlan, form: WireForm) -> str | None:
        return None

    def expand(self, plan: DispatchPlan, shard: Shard, held: Items, form: WireForm):
        tokens, row_weights = _expand_items(plan, held.rows, held.pos, held.weights, form)
        tokens, scales = form.delivered(plan, tokens)
        return tokens, scales, row_weights, HostRowsRecord(held.pos)

    def redispatch(self, plan: DispatchPlan, shard: Shard, record: HostRowsRecord, g):
        ignored = jnp.zeros(record.held_pos.shape, jnp.float32)  # no routing weights wanted
        return _expand_items(plan, g, record.held_pos, ignored, PLAIN)[0]

    def combine_vjp(self, plan: DispatchPlan, shard: Shard, record: HostRowsRecord, g, y, weights):
        return call(
            "expand_items_vjp",
            _row_types(plan, g),
            g,
            record.held_pos,
            weights,
            y,
            like=(g, record.held_pos),
            plan=plan,
            **row_attrs(plan),
        )

    def partials(
        self, plan: DispatchPlan, shard: Shard, record: HostRowsRecord, y, weights: RowWeights
    ):
        held_pos = record.held_pos
        return call(
            "item_partials",
            jax.ShapeDtypeStruct((held_pos.shape[0], y.shape[1]), y.dtype),
            y,
            weights.values,
            held_pos,
            like=(y, held_pos),
            plan=plan,
            weighted=np.bool_(weights.weighted),
        )

    def row_values(self, plan: DispatchPlan, shard: Shard, record: HostRowsRecord, values):
        return item_row_values(plan, record.held_pos, values)
