"""The fused host bottom: one custom call per direction over one level whose ranks share this
process (xla_ffi/cpu/handlers/handlers.cc).

It spans the level itself: each destination copies its rows straight from the sources' held rows
into expert-major rows (one copy per row, no staging), and each source sums its partials straight
from the destinations' outputs, in the §2.1 order (k ascending per destination, destinations
ascending). The EP rank and group arrive as operands, never from device ordinals.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_hybridep.config import DispatchPlan
from jax_hybridep.exchange import steps
from jax_hybridep.exchange.ffi_call import call, exchange_attrs, row_attrs
from jax_hybridep.exchange.steps import Items, RowWeights, Shard
from jax_hybridep.exchange.wire import PLAIN, WireForm
from jax_hybridep.pytree import pytree_record


@pytree_record
@dataclasses.dataclass(frozen=True)
class HostFusedRecord:
    dest: jax.Array  # [M, K] int32: each held (item, k)'s destination in the level, -1 for none
    pos: jax.Array  # [M, K] int32: its row there


@dataclasses.dataclass(frozen=True)
class HostFused(steps.SpanningBottom):
    def _call(self, plan: DispatchPlan, shard: Shard, name, out_types, *args, like, **attrs):
        """A handler call meeting the level's ranks, with (coord, level group) last."""
        fast = shard.fast
        return call(
            name,
            out_types,
            *args,
            fast.coord,
            fast.group,
            like=like,
            plan=plan,
            **exchange_attrs(plan, fast.size),
            **attrs,
        )

    def _rows(self, plan: DispatchPlan, shard: Shard, rows, weights, pos, dest, form: WireForm):
        out_types = (form.handler_rows(plan, rows), jax.ShapeDtypeStruct((plan.rows,), jnp.float32))
        return self._call(
            plan,
            shard,
            "dispatch",
            out_types,
            rows,
            weights,
            pos,
            dest,
            like=(rows, weights, pos),
            **row_attrs(plan, form.fp8_hidden),
        )

    def expand(self, plan: DispatchPlan, shard: Shard, held: Items, form: WireForm):
        dest = steps.fast_dest(shard.fast, held.dest)
        tokens, row_weights = self._rows(plan, shard, held.rows, held.weights, held.pos, dest, form)
        tokens, scales = form.delivered(plan, tokens)
        return tokens, scales, row_weights, HostFusedRecord(dest, held.pos)

    def redispatch(self, plan: DispatchPlan, shard: Shard, record: HostFusedRecord, g):
        # The routing weights of the rows are not wanted here: the handler's are ignored.
        ignored = jnp.zeros(record.pos.shape, jnp.float32)
        return self._rows(plan, shard, g, ignored, record.pos, record.dest, PLAIN)[0]

    def combine_vjp(self, plan: DispatchPlan, shard: Shard, record: HostFusedRecord, g, y, weights):
        out_types = (
            jax.ShapeDtypeStruct((plan.rows, g.shape[1]), g.dtype),
            jax.ShapeDtypeStruct((plan.rows,), jnp.float32),
        )
        return self._call(
            plan,
            shard,
            "combine_vjp",
            out_types,
            g,
            weights,
            y,
            record.pos,
            record.dest,
            like=(g, record.pos),
            **row_attrs(plan),
        )

    def partials(
        self, plan: DispatchPlan, shard: Shard, record: HostFusedRecord, y, weights: RowWeights
    ):
        out_type = jax.ShapeDtypeStruct((record.pos.shape[0], y.shape[1]), y.dtype)
        return self._call(
            plan,
            shard,
            "combine",
            out_type,
            y,
            weights.values,
            record.pos,
            record.dest,
            like=(y, record.pos),
            weighted=np.bool_(weights.weighted),
        )

    def row_values(self, plan: DispatchPlan, shard: Shard, record: HostFusedRecord, values):
        out_type = jax.ShapeDtypeStruct(record.pos.shape, jnp.float32)
        return self._call(
            plan,
            shard,
            "return_row_values",
            out_type,
            values,
            record.pos,
            record.dest,
            like=(values, record.pos),
        )
