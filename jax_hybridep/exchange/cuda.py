"""The CUDA transport (xla_ffi/cuda/handlers/transport.cc) as the bottom spanning the fastest level.

The contract is docs/design.md §2.1; the structure is Hybrid-EP's (docs/gpu.md):

1. The held items' routing (destination GPU in the level, row there, weight) is all-gathered over
   the level by XLA, and the slot-map kernel gives every (item, destination GPU) its dense slot in
   the destination's receive buffer and every receiver the map of its slots to rows. Nothing of it
   travels with the payload.
2. Dispatch sends one copy per (item, destination GPU) on `num_sms` blocks (bulk copies through a
   ring of whole-row stages), then permutes the received slots into expert-major rows with a wide
   kernel on every SM; only rows nobody fills are zeroed besides.
3. Combine first unpermutes on the destination (each received item's rows summed in float32 in
   ascending k, rounded once: a local custom call), then sends one partial per (source, item)
   back, and the source adds its partials in ascending GPU order.
4. Row values (the routing-weight gradient) go back by XLA: K floats per item.

Every exchange is issued on the configured stream (DispatchConfig.gpu_stream); GPUs of the level
in other processes (one process per GPU) are reached by CUDA IPC. The kernels' limits and the send
kernel's shared-memory plan come from the native module (`_native.limits()`,
`_native.module().send_plan()`), never copied here.

`CudaBottom(exchanges=...)` takes the object issuing the custom calls: `CudaExchanges` in
production; tests pass the pure-JAX twin (tests/transport_twin.py) to run this bottom on CPU.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_hybridep import _native, compat, weight_grad
from jax_hybridep.config import DispatchPlan
from jax_hybridep.exchange import steps
from jax_hybridep.exchange.ffi_call import call, i32, pad_attr, row_attrs, transport_attrs
from jax_hybridep.exchange.steps import RowWeights
from jax_hybridep.exchange.wire import WireForm
from jax_hybridep.pytree import pytree_record


def padded(n: int) -> int:
    """n rounded up to whole send chunks (the slot maps' lengths)."""
    chunk = _native.limits()["send_chunk"]
    return -(-n // chunk) * chunk


@functools.cache  # asked at every dispatch's route selection
def fp8_token_fits(token_bytes: int, ranks: int, hidden: int) -> bool:
    """Whether the send kernel can quantise tokens of `token_bytes` (H = `hidden`) whole over
    `ranks` GPUs: whole-token stages beside the row maps and the scales (wider 16-bit rows travel
    in pieces, but a token is quantised whole). The native send plan decides."""
    plan = _native.module().send_plan(token_bytes, ranks, fp8_hidden=hidden)
    return plan["stages"] > 0


@pytree_record
@dataclasses.dataclass(frozen=True)
class SlotMap:
    """One dispatch's slots over the level, for this GPU (xla_ffi/cuda/kernels/slot_map.h)."""

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


def transport_call(
    plan: DispatchPlan, fast: steps.FastLevel, name, out_types, *args, like, **attrs
):
    """One exchange over the fastest level: the custom call jax_hybridep_<name> with the level
    coordinate and group id last, on the configured stream (DispatchConfig.gpu_stream)."""
    local = plan.topology.level_local[fast.level]
    attrs.update(transport_attrs(plan, fast.size, multi_process=not local))

    def issue():
        return call(name, out_types, *args, fast.coord, fast.group, like=like, plan=plan, **attrs)

    stream = plan.config.gpu_stream
    return issue() if stream is None else compat.on_gpu_stream(issue, stream)


@dataclasses.dataclass(frozen=True)
class CudaExchanges:
    """The transport's custom calls (xla_ffi/cuda/handlers/transport.cc)."""

    def slot_map(self, plan: DispatchPlan, fast: steps.FastLevel, gathered):
        """(SlotMap, row weights [C] float32) of this GPU from the gathered routing."""
        size, items, k = gathered.shape[:3]
        chunks = padded(items) // _native.limits()["send_chunk"]
        out_types = (
            i32((padded(items), size)),
            i32((padded(size * items),)),
            i32((padded(size * items), k)),
            jax.ShapeDtypeStruct((plan.rows,), jnp.float32),
            i32((plan.rows,)),
            i32((2,)),
            i32((2 * size * size * chunks,)),  # the kernels' scratch
        )
        send_slot, recv_item, recv_rows, row_weights, row_slot, info, _ = call(
            "cuda_slot_map", out_types, gathered, fast.coord, like=(gathered,), plan=plan
        )
        return SlotMap(send_slot, recv_item, recv_rows, row_slot, info), row_weights

    def dispatch(
        self, plan: DispatchPlan, fast: steps.FastLevel, x, slots: SlotMap, form: WireForm
    ):
        """Rows [C, H]: x's tokens (FP8 on the wire: quantised by the send when x is the tokens,
        moved as bytes when x is their wire rows; dequantised by the permute, or delivered as wire
        rows with fp8_rows)."""
        return transport_call(
            plan,
            fast,
            "cuda_dispatch",
            form.handler_rows(plan, x),
            x,
            slots.send_slot,
            slots.recv_rows,
            slots.row_slot,
            slots.info,
            like=(x, slots.recv_rows),
            **row_attrs(plan, form.fp8_hidden),
        )

    def redispatch(self, plan: DispatchPlan, fast: steps.FastLevel, g, slots: SlotMap, scale=None):
        """Rows [C, H] of the held g [M, H]; with `scale`, also rows * scale (one pass)."""
        rows = jax.ShapeDtypeStruct((plan.rows, g.shape[1]), g.dtype)
        common = (slots.send_slot, slots.recv_rows, slots.row_slot, slots.info)
        if scale is None:
            return transport_call(
                plan,
                fast,
                "cuda_redispatch",
                rows,
                g,
                *common,
                like=(g, slots.info),
                **pad_attr(plan),
            )
        return transport_call(
            plan,
            fast,
            "cuda_redispatch_scaled",
            (rows, rows),
            g,
            scale,
            *common,
            like=(g, scale, slots.info),
            **pad_attr(plan),
        )

    def unpermute(
        self, plan: DispatchPlan, fast: steps.FastLevel, y, weights: RowWeights, slots: SlotMap
    ):
        """[padded(S * M), H] in y's dtype: per received slot, its rows of y summed in ascending
        k in float32 (times the weights when weighted), rounded once (local, no exchange)."""
        out = jax.ShapeDtypeStruct((slots.recv_rows.shape[0], y.shape[1]), y.dtype)
        return call(
            "cuda_unpermute",
            out,
            y,
            weights.values,
            slots.recv_rows,
            slots.info,
            like=(y, slots.recv_rows),
            plan=plan,
            weighted=np.bool_(weights.weighted),
        )

    def combine(self, plan: DispatchPlan, fast: steps.FastLevel, partials, slots: SlotMap, dest):
        """[M, H]: each held item's partials from its destinations added in ascending order."""
        out = jax.ShapeDtypeStruct((dest.shape[0], partials.shape[1]), partials.dtype)
        return transport_call(
            plan,
            fast,
            "cuda_combine",
            out,
            partials,
            slots.recv_item,
            slots.info,
            dest,
            like=(partials, dest),
        )


@pytree_record
@dataclasses.dataclass(frozen=True)
class CudaRecord:
    dest: jax.Array  # [M, K] int32: each held (item, k)'s destination GPU in the level, -1: none
    slots: SlotMap


def return_row_values(plan: DispatchPlan, fast: steps.FastLevel, dest, slots: SlotMap, values):
    """[M, K] float32: values [C] of each row back to the held (item, k) it came from (0 where
    dest is -1), by an XLA all-to-all of K floats per (source GPU, item)."""
    size, items, k = fast.size, dest.shape[0], dest.shape[1]
    padded_values = jnp.concatenate([values, jnp.zeros(1, jnp.float32)])
    rows = slots.recv_rows
    per_slot = jnp.where(rows >= 0, padded_values[jnp.where(rows >= 0, rows, -1)], 0.0)
    # Slot j's values to [source, item]; slots past n (recv_item -1) land in a dropped extra row.
    target = jnp.where(slots.recv_item >= 0, slots.recv_item, size * items)
    outgoing = jnp.zeros((size * items + 1, k), jnp.float32).at[target].set(per_slot)
    outgoing = outgoing[: size * items].reshape(size, items, k)
    back = jax.lax.all_to_all(outgoing, plan.topology.levels[fast.level], 0, 0, tiled=True)
    back = back.reshape(size, items, k)  # [destination GPU, item, k]
    picked = back[jnp.maximum(dest, 0), jnp.arange(items)[:, None], jnp.arange(k)[None, :]]
    return jnp.where(dest >= 0, picked, 0.0)


@dataclasses.dataclass(frozen=True)
class CudaBottom(steps.SpanningBottom):
    """The transport as the bottom. `exchanges` issues its custom calls (a pure-JAX twin with the
    same methods in the tests)."""

    exchanges: Any = CudaExchanges()

    def unsupported_reason(self, plan: DispatchPlan, form: WireForm) -> str | None:
        max_top_k = _native.limits()["max_top_k"]
        if plan.k > max_top_k:
            return f"the CUDA transport takes top-k <= {max_top_k} (topk_idx has k={plan.k})"
        if form.quantiser == "send":
            token_bytes = plan.hidden * np.dtype(jnp.dtype(plan.row_dtype)).itemsize
            ranks = plan.topology.level_sizes[-1]
            if not fp8_token_fits(token_bytes, ranks, plan.hidden):
                return (
                    f"FP8 dispatch over the CUDA transport quantises each token whole in shared "
                    f"memory: the tokens of {token_bytes} bytes (x has H={plan.hidden} of "
                    f"{plan.row_dtype}) do not fit beside the maps of {ranks} GPUs; use "
                    "DispatchConfig(wire_dtype=None)"
                )
        return None

    def expand(self, plan: DispatchPlan, shard: steps.Shard, held: steps.Items, form: WireForm):
        fast = shard.fast
        dest = steps.fast_dest(fast, held.dest)
        gathered = gather_routing(plan, fast, dest, held.pos, held.weights)
        slots, row_weights = self.exchanges.slot_map(plan, fast, gathered)
        tokens = self.exchanges.dispatch(plan, fast, held.rows, slots, form)
        tokens, scales = form.delivered(plan, tokens)
        return tokens, scales, row_weights, CudaRecord(dest, slots)

    def partials(
        self, plan: DispatchPlan, shard: steps.Shard, record: CudaRecord, y, weights: RowWeights
    ):
        partials = self.exchanges.unpermute(plan, shard.fast, y, weights, record.slots)
        return self.exchanges.combine(plan, shard.fast, partials, record.slots, record.dest)

    def row_values(self, plan: DispatchPlan, shard: steps.Shard, record: CudaRecord, values):
        return return_row_values(plan, shard.fast, record.dest, record.slots, values)

    def redispatch(self, plan: DispatchPlan, shard: steps.Shard, record: CudaRecord, g):
        return self.exchanges.redispatch(plan, shard.fast, g, record.slots)

    def combine_vjp(
        self, plan: DispatchPlan, shard: steps.Shard, record: CudaRecord, g, y, weights
    ):
        # The transport writes the rows of g and the scaled rows in one pass; the weight gradient
        # is weight_grad.row_dot, as in the xla backend.
        rows, scaled = self.exchanges.redispatch(plan, shard.fast, g, record.slots, scale=weights)
        return scaled, weight_grad.row_dot(plan.topology.platform, y, rows)
