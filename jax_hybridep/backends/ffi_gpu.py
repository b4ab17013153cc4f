"""The `ffi` backend on GPUs: CUDA handlers (xla_ffi/cuda/cuda_handlers.cc) over the direct-write
transport, with slower levels through XLA collectives (NCCL).

The fastest level (the only one, or the last under slower ones) runs the transport: each GPU
writes one copy per (item, destination GPU) into the destinations' registered windows, which
expand them into expert-major rows; combine sends each (item, destination) partial back the same
way. Slower levels (other nodes) are walked first with the xla backend's per-level steps (jnp
packing + `all_to_all`), so the transport sees the items a rank holds after them, exactly as the
xla backend's last level would; combine and the VJPs return over those levels with the same
steps. Layout: counts all-gathered by an XLA collective, planned by the CUDA layout kernels.

Dispatch keeps, in the handle, the receiver's map of rows to (source, item, k) (`recv_row_pos`),
which combine and the VJPs send back along. GPUs of the fast level in other processes (one
process per GPU) are reached by CUDA IPC (`multi_process`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.compute_on import compute_on

from jax_hybridep import compat, weight_grad
from jax_hybridep.backends import xla
from jax_hybridep.backends.ffi_call import call, i32, layout_attrs, level_peer, next_site
from jax_hybridep.config import Plan
from jax_hybridep.handle import Handle, Layout


def layout(plan: Plan, topk_idx, rank, group) -> Layout:
    _, _, gathered = xla.gather_counts(plan, topk_idx)
    out_types = (i32(topk_idx.shape), i32((plan.num_slots,)), i32((plan.num_experts,)),
                 jax.ShapeDtypeStruct((), jnp.int64), i32(()))  # fmt: skip
    row_pos, sizes, per_expert, dropped, invalid = call(
        "cuda_layout", out_types, topk_idx, gathered, rank, group, like=(topk_idx, gathered),
        plan=plan, exchange=False, site=next_site(), **layout_attrs(plan),
    )  # fmt: skip
    return Layout(row_pos, sizes, per_expert, dropped.astype(jnp.int32), invalid)


@dataclasses.dataclass(frozen=True)
class FastLevel:
    """The level the transport spans, seen from one rank."""

    level: int  # index in the topology (the last)
    ranks: int  # GPUs in the level group
    coord: jax.Array  # this GPU's coordinate in it
    group: jax.Array  # the level group's id (keys its windows)


def _fast(plan: Plan, rank, group) -> FastLevel:
    last = len(plan.topology.levels) - 1
    coord, level_group = level_peer(plan, last, rank, group)
    return FastLevel(last, plan.topology.level_sizes[last], coord, level_group)


class CudaTransport:
    """The transport's exchanges over the fast level, as custom calls to the CUDA handlers.

    dest [M, K]: each held item's destination coordinate in the level (-1: none); recv_row_pos
    [ranks * M, K]: the receiver's rows per (source, item, k), from dispatch.
    """

    def _call(self, plan: Plan, *args, **kwargs):
        """`call`, on the configured stream (DispatchConfig.gpu_stream) when there is one."""
        stream = plan.config.gpu_stream
        if stream is None:
            return call(*args, plan=plan, **kwargs)
        on_stream = compute_on(
            lambda: call(*args, plan=plan, **kwargs),
            compute_type=f"gpu_stream:{stream}",
            out_memory_spaces=compat.device_memory_space(),
        )
        return on_stream()

    def _attrs(self, plan: Plan, fast: FastLevel):
        local = plan.topology.level_local
        in_process = plan.topology.single_process if local is None else local[fast.level]
        return dict(
            num_ranks=np.int64(fast.ranks),
            num_sms=np.int64(plan.config.num_sms),
            # GPUs of the level in other processes (one process per GPU) are reached by CUDA IPC.
            multi_process=np.bool_(not in_process),
        )

    def dispatch(self, plan: Plan, fast: FastLevel, x, weights, row_pos, dest):
        """(rows [C, H], row weights [C], recv_row_pos)."""
        out_types = (
            jax.ShapeDtypeStruct((plan.rows, x.shape[1]), x.dtype),
            jax.ShapeDtypeStruct((plan.rows,), jnp.float32),
            i32((fast.ranks * x.shape[0], plan.k)),
        )
        return self._call(
            plan, "cuda_dispatch", out_types, x, weights, row_pos, dest, fast.coord, fast.group,
            like=(x, weights, row_pos), **self._attrs(plan, fast),
        )  # fmt: skip

    def _along(self, name, out_types, plan, fast, *args, dest, recv_row_pos, like, **attrs):
        return self._call(plan, name, out_types, *args, dest, recv_row_pos, fast.coord, fast.group,
                          like=like + (dest,), **self._attrs(plan, fast), **attrs)  # fmt: skip

    def redispatch(self, plan: Plan, fast: FastLevel, g, dest, recv_row_pos, scale=None):
        """Rows [C, H] of the held g [M, H]; with `scale`, also rows * scale (one pass)."""
        rows = jax.ShapeDtypeStruct((plan.rows, g.shape[1]), g.dtype)
        if scale is None:
            return self._along("cuda_redispatch", rows, plan, fast, g, dest=dest,
                               recv_row_pos=recv_row_pos, like=(g,))  # fmt: skip
        return self._along("cuda_redispatch_scaled", (rows, rows), plan, fast, g, scale,
                           dest=dest, recv_row_pos=recv_row_pos, like=(g, scale))  # fmt: skip

    def combine(self, plan: Plan, fast: FastLevel, y, weights, dest, recv_row_pos):
        """[M, H] in y's dtype: each held item's partials over its destinations."""
        weighted = weights is not None
        if not weighted:
            weights = jnp.zeros((plan.rows,), jnp.float32)  # ignored by the handler
        out_type = jax.ShapeDtypeStruct((dest.shape[0], y.shape[1]), y.dtype)
        return self._along(
            "cuda_combine", out_type, plan, fast, y, weights, dest=dest,
            recv_row_pos=recv_row_pos, like=(y,), weighted=np.bool_(weighted),
        )  # fmt: skip

    def return_row_values(self, plan: Plan, fast: FastLevel, values, dest, recv_row_pos):
        """[M, K] float32: values[row] back to each held (item, k); 0 where dest is -1."""
        out_type = jax.ShapeDtypeStruct(dest.shape, jnp.float32)
        return self._along("cuda_return_row_values", out_type, plan, fast, values, dest=dest,
                           recv_row_pos=recv_row_pos, like=(values,))  # fmt: skip


# The kernels' limit on routing slots per token (xla_ffi/cuda/transport.cu, CheckContext).
MAX_TOP_K = 64

# The transport in use: tests swap in a pure-JAX twin to check the composition on CPU devices.
TRANSPORT = CudaTransport()


def dispatch(plan: Plan, x, weights, row_pos, dest, rank, group):
    if plan.k > MAX_TOP_K:
        raise ValueError(
            f"the CUDA transport takes top-k <= {MAX_TOP_K} (topk_idx has k={plan.k}); "
            "use backend='xla'"
        )
    slow = range(len(plan.topology.levels) - 1)
    held, records = xla.send_levels(plan, (x, dest, row_pos, weights), slow)
    held_x, held_dest, held_pos, held_w = held
    fast = _fast(plan, rank, group)
    fast_dest = jnp.where(
        held_dest >= 0, held_dest % fast.ranks, -1
    )  # the last level's stride is 1
    tokens, row_weights, recv_row_pos = TRANSPORT.dispatch(
        plan, fast, held_x, held_w, held_pos, fast_dest
    )
    private = (records, fast_dest, recv_row_pos)
    return tokens, row_weights, Handle(row_pos, dest, rank, group, private, plan)


def level_rows(handle: Handle):
    """[levels] int32: item copies this shard sent to other ranks at each level."""
    plan = handle.plan
    records, fast_dest, _ = handle.private
    slow = [
        xla.copies_to_others(plan, level, handle.rank, send_item >= 0)
        for level, (send_item, _, _) in enumerate(records)
    ]
    fast = _fast(plan, handle.rank, handle.group)
    peers = jnp.arange(fast.ranks)
    to_peer = jnp.any(fast_dest[:, :, None] == peers, axis=1) & (peers != fast.coord)
    return jnp.stack(slow + [jnp.sum(to_peer, dtype=jnp.int32)])


def _along(handle: Handle):
    """(plan, fast level, slow-level records, fast dest, receive map) of a dispatch."""
    records, fast_dest, recv_row_pos = handle.private
    fast = _fast(handle.plan, handle.rank, handle.group)
    return handle.plan, fast, records, fast_dest, recv_row_pos


def redispatch(handle: Handle, g):
    """Rows [C, H] of g [T, H] along an existing dispatch (combine's VJP)."""
    plan, fast, records, dest, recv = _along(handle)
    return TRANSPORT.redispatch(plan, fast, xla.forward_levels(plan, records, g), dest, recv)


def combine_vjp(handle: Handle, g, y, weights):
    """A weighted combine's VJP as xla.combine_vjp: the transport writes the rows of g and the
    scaled rows in one pass; the weight gradient is weight_grad.row_dot, as in the xla backend."""
    plan, fast, records, dest, recv = _along(handle)
    held = xla.forward_levels(plan, records, g)
    rows, scaled = TRANSPORT.redispatch(plan, fast, held, dest, recv, scale=weights)
    return scaled, weight_grad.row_dot(plan.topology.platform, y, rows)


def combine(handle: Handle, y, weights):
    plan, fast, records, dest, recv = _along(handle)
    partials = TRANSPORT.combine(plan, fast, y, weights, dest, recv)
    return xla.reduce_levels(plan, records, partials, y.dtype)


def return_row_values(handle: Handle, values):
    """[T, K] float32: values[row] sent back to the (t, k) each row came from; 0 elsewhere."""
    plan, fast, records, dest, recv = _along(handle)
    per_item = TRANSPORT.return_row_values(plan, fast, values, dest, recv)
    return xla.pick_levels(plan, records, per_item)
