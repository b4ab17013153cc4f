"""The CUDA transport (xla_ffi/cuda/transport_handlers.cc) as the bottom spanning the fastest level.

Each GPU writes one copy per (item, destination GPU) into the destinations' registered windows,
which expand them into expert-major rows; combine sends each (item, destination) partial back the
same way. Dispatch keeps, in the record, the receiver's map of rows to (source, item, k)
(`recv_row_pos`), which combine and the VJPs send back along. GPUs of the level in other
processes (one process per GPU) are reached by CUDA IPC (`multi_process`).

`CudaBottom(exchanges=...)` takes the object issuing the exchanges: `CudaExchanges` (the custom
calls) in production; tests pass a pure-JAX twin with the same methods to run this bottom on CPU.
What it shares with transport v2 (the top-k limit, how a call is issued, the structure of the
bottom) is in cuda_transport.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_hybridep.config import DispatchPlan
from jax_hybridep.exchange import steps, wire
from jax_hybridep.exchange.cuda_transport import TransportBottom, transport_call
from jax_hybridep.exchange.ffi_call import i32


@dataclasses.dataclass(frozen=True)
class CudaExchanges:
    """The transport's exchanges over the fast level, as custom calls to the CUDA handlers.

    dest [M, K]: each held item's destination coordinate in the level (-1: none); recv_row_pos
    [ranks * M, K]: the receiver's rows per (source, item, k), from dispatch.
    """

    def dispatch(self, plan: DispatchPlan, fast: steps.FastLevel, x, weights, row_pos, dest):
        """(rows [C, H], row weights [C], recv_row_pos). With FP8 on the wire (wire.py) x is
        either the tokens, which the send kernel quantises, or their wire rows (u8), and the rows
        come out dequantised, or as wire rows with fp8_rows."""
        out_types = (
            wire.transport_rows(plan, x),
            jax.ShapeDtypeStruct((plan.rows,), jnp.float32),
            i32((fast.size * x.shape[0], plan.k)),
        )
        fp8_hidden = 0 if plan.config.wire_dtype is None else plan.hidden
        return transport_call(plan, fast, "cuda_dispatch", out_types, x, weights, row_pos, dest,
                              like=(x, weights, row_pos),
                              fp8_hidden=np.int64(fp8_hidden))  # fmt: skip

    def redispatch(self, plan: DispatchPlan, fast: steps.FastLevel, g, dest, recv_row_pos,
                   scale=None):  # fmt: skip
        """Rows [C, H] of the held g [M, H]; with `scale`, also rows * scale (one pass)."""
        rows = jax.ShapeDtypeStruct((plan.rows, g.shape[1]), g.dtype)
        if scale is None:
            return transport_call(plan, fast, "cuda_redispatch", rows, g, dest, recv_row_pos,
                                  like=(g, dest))  # fmt: skip
        return transport_call(plan, fast, "cuda_redispatch_scaled", (rows, rows), g, scale, dest,
                              recv_row_pos, like=(g, scale, dest))  # fmt: skip

    def combine(self, plan: DispatchPlan, fast: steps.FastLevel, y, weights, dest, recv_row_pos):
        """[M, H] in y's dtype: each held item's partials over its destinations."""
        weighted = weights is not None
        if not weighted:
            weights = jnp.zeros((plan.rows,), jnp.float32)  # ignored by the handler
        out_type = jax.ShapeDtypeStruct((dest.shape[0], y.shape[1]), y.dtype)
        return transport_call(plan, fast, "cuda_combine", out_type, y, weights, dest, recv_row_pos,
                              like=(y, dest), weighted=np.bool_(weighted))  # fmt: skip

    def return_row_values(self, plan: DispatchPlan, fast: steps.FastLevel, values, dest,
                          recv_row_pos):  # fmt: skip
        """[M, K] float32: values[row] back to each held (item, k); 0 where dest is -1."""
        out_type = jax.ShapeDtypeStruct(dest.shape, jnp.float32)
        return transport_call(plan, fast, "cuda_return_row_values", out_type, values, dest,
                              recv_row_pos, like=(values, dest))  # fmt: skip


@steps.pytree_record
@dataclasses.dataclass(frozen=True)
class CudaRecord:
    dest: jax.Array  # [M, K] int32: each held (item, k)'s destination GPU in the level, -1: none
    recv_row_pos: jax.Array  # [size * M, K] int32: the receiver's row per (source, item, k)

    @property
    def route(self):
        """What the exchanges take to retrace the dispatch."""
        return self.dest, self.recv_row_pos


@dataclasses.dataclass(frozen=True)
class CudaBottom(TransportBottom):
    exchanges: Any = CudaExchanges()

    def send(self, plan: DispatchPlan, fast: steps.FastLevel, held: steps.Items, dest):
        tokens, row_weights, recv_row_pos = self.exchanges.dispatch(
            plan, fast, held.rows, held.weights, held.pos, dest
        )
        return tokens, row_weights, CudaRecord(dest, recv_row_pos)

    def partials(self, plan: DispatchPlan, shard: steps.Shard, record: CudaRecord, y, weights):
        fast = steps.fast_level(plan, shard)
        return self.exchanges.combine(plan, fast, y, weights, *record.route)

    def row_values(self, plan: DispatchPlan, shard: steps.Shard, record: CudaRecord, values):
        fast = steps.fast_level(plan, shard)
        return self.exchanges.return_row_values(plan, fast, values, *record.route)
