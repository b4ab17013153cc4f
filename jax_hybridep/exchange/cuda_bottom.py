"""The CUDA transport (xla_ffi/cuda/transport_handlers.cc) as the bottom spanning the fastest level.

Each GPU writes one copy per (item, destination GPU) into the destinations' registered windows,
which expand them into expert-major rows; combine sends each (item, destination) partial back the
same way. Dispatch keeps, in the record, the receiver's map of rows to (source, item, k)
(`recv_row_pos`), which combine and the VJPs send back along. GPUs of the level in other
processes (one process per GPU) are reached by CUDA IPC (`multi_process`).

`CudaBottom(exchanges=...)` takes the object issuing the exchanges: `CudaExchanges` (the custom
calls) in production; tests pass a pure-JAX twin with the same methods to run this bottom on CPU.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_hybridep import compat, weight_grad
from jax_hybridep.config import DispatchPlan
from jax_hybridep.exchange import wire
from jax_hybridep.exchange.ffi_call import call, i32, transport_attrs
from jax_hybridep.exchange.steps import (
    FastLevel,
    Items,
    Shard,
    fast_dest,
    fast_level,
    pytree_record,
    span_copies,
)

# The kernels' limit on routing slots per token (xla_ffi/limits.h: kMaxTopK; tests/native_test.py
# checks it).
MAX_TOP_K = 64


@dataclasses.dataclass(frozen=True)
class CudaExchanges:
    """The transport's exchanges over the fast level, as custom calls to the CUDA handlers.

    dest [M, K]: each held item's destination coordinate in the level (-1: none); recv_row_pos
    [ranks * M, K]: the receiver's rows per (source, item, k), from dispatch.
    """

    def _call(self, plan: DispatchPlan, fast: FastLevel, name, out_types, *args, like, **attrs):
        """One exchange over the level, on the configured stream (DispatchConfig.gpu_stream)."""
        # GPUs of the level in other processes (one process per GPU) are reached by CUDA IPC.
        local = plan.topology.level_local[fast.level]
        attrs.update(transport_attrs(plan, fast.size, multi_process=not local))

        def issue():
            return call(f"cuda_{name}", out_types, *args, fast.coord, fast.group, like=like,
                        plan=plan, **attrs)  # fmt: skip

        stream = plan.config.gpu_stream
        return issue() if stream is None else compat.on_gpu_stream(issue, stream)

    def dispatch(self, plan: DispatchPlan, fast: FastLevel, x, weights, row_pos, dest):
        """(rows [C, H], row weights [C], recv_row_pos). With FP8 on the wire (wire.py) x is
        either the tokens, which the send kernel quantises, or their wire rows (u8), and the rows
        come out dequantised, or as wire rows with fp8_rows."""
        out_types = (
            wire.transport_rows(plan, x),
            jax.ShapeDtypeStruct((plan.rows,), jnp.float32),
            i32((fast.size * x.shape[0], plan.k)),
        )
        fp8_hidden = 0 if plan.config.wire_dtype is None else plan.hidden
        return self._call(plan, fast, "dispatch", out_types, x, weights, row_pos, dest,
                          like=(x, weights, row_pos), fp8_hidden=np.int64(fp8_hidden))  # fmt: skip

    def redispatch(self, plan: DispatchPlan, fast: FastLevel, g, dest, recv_row_pos, scale=None):
        """Rows [C, H] of the held g [M, H]; with `scale`, also rows * scale (one pass)."""
        rows = jax.ShapeDtypeStruct((plan.rows, g.shape[1]), g.dtype)
        if scale is None:
            return self._call(plan, fast, "redispatch", rows, g, dest, recv_row_pos,
                              like=(g, dest))  # fmt: skip
        return self._call(plan, fast, "redispatch_scaled", (rows, rows), g, scale, dest,
                          recv_row_pos, like=(g, scale, dest))  # fmt: skip

    def combine(self, plan: DispatchPlan, fast: FastLevel, y, weights, dest, recv_row_pos):
        """[M, H] in y's dtype: each held item's partials over its destinations."""
        weighted = weights is not None
        if not weighted:
            weights = jnp.zeros((plan.rows,), jnp.float32)  # ignored by the handler
        out_type = jax.ShapeDtypeStruct((dest.shape[0], y.shape[1]), y.dtype)
        return self._call(plan, fast, "combine", out_type, y, weights, dest, recv_row_pos,
                          like=(y, dest), weighted=np.bool_(weighted))  # fmt: skip

    def return_row_values(self, plan: DispatchPlan, fast: FastLevel, values, dest, recv_row_pos):
        """[M, K] float32: values[row] back to each held (item, k); 0 where dest is -1."""
        out_type = jax.ShapeDtypeStruct(dest.shape, jnp.float32)
        return self._call(plan, fast, "return_row_values", out_type, values, dest, recv_row_pos,
                          like=(values, dest))  # fmt: skip


@pytree_record
@dataclasses.dataclass(frozen=True)
class CudaRecord:
    dest: jax.Array  # [M, K] int32: each held (item, k)'s destination GPU in the level, -1: none
    recv_row_pos: jax.Array  # [size * M, K] int32: the receiver's row per (source, item, k)


@dataclasses.dataclass(frozen=True)
class CudaBottom:
    exchanges: Any = CudaExchanges()

    spans_level = True

    def expand(self, plan: DispatchPlan, shard: Shard, held: Items):
        if plan.k > MAX_TOP_K:
            raise ValueError(
                f"the CUDA transport takes top-k <= {MAX_TOP_K} (topk_idx has k={plan.k}); "
                "use backend='xla'"
            )
        fast = fast_level(plan, shard)
        dest = fast_dest(fast, held.dest)
        tokens, row_weights, recv_row_pos = self.exchanges.dispatch(
            plan, fast, held.rows, held.weights, held.pos, dest
        )
        tokens, scales = wire.handler_tokens(plan, tokens)
        return tokens, scales, row_weights, CudaRecord(dest, recv_row_pos)

    def redispatch(self, plan: DispatchPlan, shard: Shard, record: CudaRecord, g):
        fast = fast_level(plan, shard)
        return self.exchanges.redispatch(plan, fast, g, record.dest, record.recv_row_pos)

    def combine_vjp(self, plan: DispatchPlan, shard: Shard, record: CudaRecord, g, y, weights):
        # The transport writes the rows of g and the scaled rows in one pass; the weight gradient
        # is weight_grad.row_dot, as in the xla backend.
        fast = fast_level(plan, shard)
        rows, scaled = self.exchanges.redispatch(
            plan, fast, g, record.dest, record.recv_row_pos, scale=weights
        )
        return scaled, weight_grad.row_dot(plan.topology.platform, y, rows)

    def partials(self, plan: DispatchPlan, shard: Shard, record: CudaRecord, y, weights):
        fast = fast_level(plan, shard)
        return self.exchanges.combine(plan, fast, y, weights, record.dest, record.recv_row_pos)

    def row_values(self, plan: DispatchPlan, shard: Shard, record: CudaRecord, values):
        fast = fast_level(plan, shard)
        return self.exchanges.return_row_values(
            plan, fast, values, record.dest, record.recv_row_pos
        )

    def copies(self, plan: DispatchPlan, shard: Shard, record: CudaRecord):
        return span_copies(fast_level(plan, shard), record.dest)
