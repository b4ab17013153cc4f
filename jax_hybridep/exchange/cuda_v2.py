"""Transport v2 (xla_ffi/cuda/v2_handlers.cc) as the bottom spanning the fastest GPU level.

Selected by `DispatchConfig(gpu_transport="v2")`; the same contract and bits as transport v1
(exchange/cuda_bottom.py, docs/design.md §2.1), on Hybrid-EP's structure (docs/gpu.md,
"Transport v2"):

1. The held items' routing (destination GPU in the level, row there, weight) is all-gathered over
   the level by XLA, and a layout kernel gives every (item, destination GPU) its dense slot in the
   destination's receive buffer and every receiver the map of its slots to rows. Nothing of it
   travels with the payload.
2. Dispatch sends one copy per (item, destination GPU) on `num_sms` blocks (bulk copies through a
   ring of whole-row stages), then permutes the received slots into expert-major rows with a wide
   kernel on every SM; only rows nobody fills are zeroed besides.
3. Combine first unpermutes on the destination (each received item's rows summed in float32 in
   ascending k, rounded once: a local custom call), then sends one partial per (source, item)
   back on `num_sms` blocks, and the source adds its partials in ascending GPU order.
4. Row values (the routing-weight gradient) go back by XLA: K floats per item.

`CudaV2Bottom(exchanges=...)` takes the object issuing the custom calls: `CudaV2Exchanges` in
production; tests pass the pure-JAX twin (tests/transport_v2_twin.py) to run this bottom on CPU.
What it shares with transport v1 is in cuda_transport.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_hybridep import fp8
from jax_hybridep.config import DispatchPlan
from jax_hybridep.exchange import steps, wire
from jax_hybridep.exchange.cuda_transport import TransportBottom, transport_call
from jax_hybridep.exchange.ffi_call import call, i32

# Items per send chunk; the layout's maps are padded to whole chunks (xla_ffi/cuda/v2_layout.h).
CHUNK = 64
# The send kernel's shared memory on Hopper (opt-in per block; v2_transport.h kV2SharedBudget).
SHARED_BUDGET = 232448


def fp8_token_fits(token_bytes: int, ranks: int, hidden: int) -> bool:
    """Whether the send kernel can quantise tokens of `token_bytes` (H = `hidden`) whole over
    `ranks` GPUs: 4 stages of a whole token beside the two row maps and the 3 store warps' scales
    (wider 16-bit rows travel in pieces, but a token is quantised whole). Mirrors v2_send.cu's
    PlanV2Send (tests/cuda_v2_sass_test.py holds them together)."""

    def round_up(n, m):
        return -(-n // m) * m

    fixed = round_up(2 * CHUNK * ranks * 4, 128) + 3 * round_up(4 * -(-hidden // fp8.BLOCK), 16)
    room = SHARED_BUDGET - fixed - 2048  # v2_send.cu's kStaticReserve
    return room >= 16 * 4 and room // round_up(max(token_bytes, 16), 16) >= 4


def padded(n: int) -> int:
    return -(-n // CHUNK) * CHUNK


@steps.pytree_record
@dataclasses.dataclass(frozen=True)
class V2Layout:
    """One dispatch's layout over the level, for this GPU (xla_ffi/cuda/v2_layout.h)."""

    send_slot: jax.Array  # [padded(M), S] int32: item m's slot at GPU p, -1 when it does not go
    recv_item: jax.Array  # [padded(S * M)] int32: slot j's source * M + item, -1 past n
    recv_rows: jax.Array  # [padded(S * M), K] int32: slot j's row per k, -1 for none
    row_slot: jax.Array  # [C] int32: the slot feeding each row, -1 for padding rows
    info: jax.Array  # [2] int32: n (slots received), last filled row + 1


def gather_routing(plan: DispatchPlan, fast: steps.FastLevel, dest, pos, weights):
    """[S, M, K, 3] int32: every GPU of the level's (destination, row, weight bits) per (item, k),
    by an XLA all-gather over the level (NCCL on GPUs)."""
    routing = jnp.stack([dest, pos, jax.lax.bitcast_convert_type(weights, jnp.int32)], axis=-1)
    return jax.lax.all_gather(routing, plan.topology.levels[fast.level])


def _rows_attr(plan: DispatchPlan) -> np.int64:
    """The rows nobody fills that stay unwritten: those past sum(group_sizes) with
    DispatchConfig(zero_padding=False) (their pad multiple), none otherwise (0)."""
    return np.int64(0 if plan.config.zero_padding else plan.config.pad_multiple)


@dataclasses.dataclass(frozen=True)
class CudaV2Exchanges:
    """Transport v2's custom calls (xla_ffi/cuda/v2_handlers.cc)."""

    def layout(self, plan: DispatchPlan, fast: steps.FastLevel, gathered):
        """(V2Layout, row weights [C] float32) of this GPU from the gathered routing."""
        size, items, k = gathered.shape[:3]
        out_types = (
            i32((padded(items), size)),
            i32((padded(size * items),)),
            i32((padded(size * items), k)),
            jax.ShapeDtypeStruct((plan.rows,), jnp.float32),
            i32((plan.rows,)),
            i32((2,)),
            i32((2 * size * size * (padded(items) // CHUNK),)),  # the kernels' scratch
        )
        send_slot, recv_item, recv_rows, row_weights, row_slot, info, _ = call(
            "cuda_v2_layout", out_types, gathered, fast.coord, like=(gathered,), plan=plan
        )
        return V2Layout(send_slot, recv_item, recv_rows, row_slot, info), row_weights

    def dispatch(self, plan: DispatchPlan, fast: steps.FastLevel, x, lay: V2Layout):
        """Rows [C, H]: x's tokens (FP8 on the wire: quantised by the send when x is the tokens,
        moved as bytes when x is their wire rows; dequantised by the permute, or delivered as wire
        rows with fp8_rows)."""
        fp8_hidden = 0 if plan.config.wire_dtype is None else plan.hidden
        return transport_call(
            plan, fast, "cuda_v2_dispatch", wire.transport_rows(plan, x), x, lay.send_slot,
            lay.recv_rows, lay.row_slot, lay.info, like=(x, lay.recv_rows),
            fp8_hidden=np.int64(fp8_hidden), sparse_pad_multiple=_rows_attr(plan),
        )  # fmt: skip

    def redispatch(self, plan: DispatchPlan, fast: steps.FastLevel, g, lay: V2Layout, scale=None):
        """Rows [C, H] of the held g [M, H]; with `scale`, also rows * scale (one pass)."""
        rows = jax.ShapeDtypeStruct((plan.rows, g.shape[1]), g.dtype)
        common = (lay.send_slot, lay.recv_rows, lay.row_slot, lay.info)
        if scale is None:
            return transport_call(plan, fast, "cuda_v2_redispatch", rows, g, *common,
                                  like=(g, lay.info),
                                  sparse_pad_multiple=_rows_attr(plan))  # fmt: skip
        return transport_call(plan, fast, "cuda_v2_redispatch_scaled", (rows, rows), g, scale,
                              *common, like=(g, scale, lay.info),
                              sparse_pad_multiple=_rows_attr(plan))  # fmt: skip

    def unpermute(self, plan: DispatchPlan, fast: steps.FastLevel, y, weights, lay: V2Layout):
        """[padded(S * M), H] in y's dtype: per received slot, its rows of y summed in ascending
        k in float32 (times `weights` unless None), rounded once (local, no exchange)."""
        weighted = weights is not None
        if not weighted:
            weights = jnp.zeros((plan.rows,), jnp.float32)  # ignored by the handler
        out = jax.ShapeDtypeStruct((lay.recv_rows.shape[0], y.shape[1]), y.dtype)
        return call("cuda_v2_unpermute", out, y, weights, lay.recv_rows, lay.info,
                    like=(y, lay.recv_rows), plan=plan, weighted=np.bool_(weighted))  # fmt: skip

    def combine(self, plan: DispatchPlan, fast: steps.FastLevel, partials, lay: V2Layout, dest):
        """[M, H]: each held item's partials from its destinations added in ascending order."""
        out = jax.ShapeDtypeStruct((dest.shape[0], partials.shape[1]), partials.dtype)
        return transport_call(plan, fast, "cuda_v2_combine", out, partials, lay.recv_item,
                              lay.info, dest, like=(partials, dest))  # fmt: skip


@steps.pytree_record
@dataclasses.dataclass(frozen=True)
class CudaV2Record:
    dest: jax.Array  # [M, K] int32: each held (item, k)'s destination GPU in the level, -1: none
    layout: V2Layout

    @property
    def route(self):
        """What the exchanges take to retrace the dispatch."""
        return (self.layout,)


def return_row_values(plan: DispatchPlan, fast: steps.FastLevel, dest, lay: V2Layout, values):
    """[M, K] float32: values [C] of each row back to the held (item, k) it came from (0 where
    dest is -1), by an XLA all-to-all of K floats per (source GPU, item)."""
    size, items, k = fast.size, dest.shape[0], dest.shape[1]
    padded_values = jnp.concatenate([values, jnp.zeros(1, jnp.float32)])
    rows = lay.recv_rows
    per_slot = jnp.where(rows >= 0, padded_values[jnp.where(rows >= 0, rows, -1)], 0.0)
    # Slot j's values to [source, item]; slots past n (recv_item -1) land in a dropped extra row.
    target = jnp.where(lay.recv_item >= 0, lay.recv_item, size * items)
    outgoing = jnp.zeros((size * items + 1, k), jnp.float32).at[target].set(per_slot)
    outgoing = outgoing[: size * items].reshape(size, items, k)
    back = jax.lax.all_to_all(outgoing, plan.topology.levels[fast.level], 0, 0, tiled=True)
    back = back.reshape(size, items, k)  # [destination GPU, item, k]
    picked = back[jnp.maximum(dest, 0), jnp.arange(items)[:, None], jnp.arange(k)[None, :]]
    return jnp.where(dest >= 0, picked, 0.0)


@dataclasses.dataclass(frozen=True)
class CudaV2Bottom(TransportBottom):
    exchanges: Any = CudaV2Exchanges()

    def check_rows(self, plan: DispatchPlan, rows) -> None:
        if plan.config.wire_dtype is not None and rows.dtype != jnp.uint8:
            token_bytes = rows.shape[1] * rows.dtype.itemsize
            ranks = plan.topology.level_sizes[-1]
            if not fp8_token_fits(token_bytes, ranks, rows.shape[1]):
                raise ValueError(
                    f"FP8 dispatch over gpu_transport='v2' quantises each token whole in shared "
                    f"memory: 4 tokens of {token_bytes} bytes (x has H={rows.shape[1]} of "
                    f"{rows.dtype}) do not fit beside the maps of {ranks} GPUs; use "
                    "gpu_transport='v1'"
                )

    def send(self, plan: DispatchPlan, fast: steps.FastLevel, held: steps.Items, dest):
        gathered = gather_routing(plan, fast, dest, held.pos, held.weights)
        lay, row_weights = self.exchanges.layout(plan, fast, gathered)
        tokens = self.exchanges.dispatch(plan, fast, held.rows, lay)
        return tokens, row_weights, CudaV2Record(dest, lay)

    def partials(self, plan: DispatchPlan, shard: steps.Shard, record: CudaV2Record, y, weights):
        fast = steps.fast_level(plan, shard)
        partials = self.exchanges.unpermute(plan, fast, y, weights, record.layout)
        return self.exchanges.combine(plan, fast, partials, record.layout, record.dest)

    def row_values(self, plan: DispatchPlan, shard: steps.Shard, record: CudaV2Record, values):
        fast = steps.fast_level(plan, shard)
        return return_row_values(plan, fast, record.dest, record.layout, values)
