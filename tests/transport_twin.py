"""A pure-JAX twin of the CUDA transport's exchanges (exchange.cuda_bottom.CudaExchanges).

Same inputs, outputs and §2.1 order as the CUDA handlers, built from masks and `all_to_all` over
the fast level's axes, so tests can run the GPU path's composition (slow levels through XLA
collectives, the transport on the fastest level, the handle's receive map, the VJPs) on fake CPU
devices against the xla backend. Slot (source, item) of the receive map is t-indexed like the
CUDA windows: recv_row_pos[src * M + t].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_hybridep import fp8


def _all_to_all(plan, fast, a):
    return jax.lax.all_to_all(a, plan.topology.levels[fast.level], 0, 0, tiled=True)


def _per_peer(fast, dest, values, fill, per_k):
    """[S * M, ...]: for peer p, each item's values where it goes to p (per (item, k) when
    per_k, else per item: the item's row), else fill."""
    peers = jnp.arange(fast.size)
    here = dest[None] == peers[:, None, None]  # [S, M, K]
    if per_k:
        out = jnp.where(here, values[None], fill)
    else:
        out = jnp.where(jnp.any(here, axis=2)[:, :, None], values[None], fill)
    return out.reshape((-1,) + values.shape[1:])


def _rows_from(plan, recv_row_pos, per_slot):
    """Expert-major [C, ...]: per_slot[slot] in every row recv_row_pos gives it, zero elsewhere."""
    flat = recv_row_pos.reshape(-1)
    target = jnp.where(flat >= 0, flat, plan.rows)
    values = jnp.repeat(per_slot, plan.k, axis=0)
    out = jnp.zeros((plan.rows + 1,) + per_slot.shape[1:], per_slot.dtype)
    return out.at[target].set(values)[: plan.rows]


class JaxExchanges:
    def dispatch(self, plan, fast, x, weights, row_pos, dest):
        # FP8 on the wire: tokens are quantised as the send kernel does, wire rows moved as bytes
        # and dequantised as the receive kernel does (fp8_rows: delivered as they are).
        fp8_wire = plan.config.wire_dtype is not None
        if fp8_wire and x.dtype != jnp.uint8:
            x = fp8.to_wire(*fp8.quantize(x))
        rows, row_weights, recv_row_pos = self._dispatch(plan, fast, x, weights, row_pos, dest)
        if fp8_wire and not plan.config.fp8_rows:
            rows = fp8.dequantize(*fp8.from_wire(rows, plan.hidden), plan.row_dtype)
        return rows, row_weights, recv_row_pos

    def _dispatch(self, plan, fast, x, weights, row_pos, dest):
        recv_x = _all_to_all(plan, fast, _per_peer(fast, dest, x, 0, per_k=False))
        recv_row_pos = _all_to_all(plan, fast, _per_peer(fast, dest, row_pos, -1, per_k=True))
        recv_w = _all_to_all(plan, fast, _per_peer(fast, dest, weights, 0.0, per_k=True))
        rows = _rows_from(plan, recv_row_pos, recv_x)
        flat = recv_row_pos.reshape(-1)
        target = jnp.where(flat >= 0, flat, plan.rows)
        row_weights = jnp.zeros(plan.rows + 1, jnp.float32).at[target].set(recv_w.reshape(-1))
        return rows, row_weights[: plan.rows], recv_row_pos

    def redispatch(self, plan, fast, g, dest, recv_row_pos, scale=None):
        rows = _rows_from(
            plan, recv_row_pos, _all_to_all(plan, fast, _per_peer(fast, dest, g, 0, per_k=False))
        )
        if scale is None:
            return rows
        return rows, (rows.astype(jnp.float32) * scale[:, None]).astype(rows.dtype)

    def combine(self, plan, fast, y, weights, dest, recv_row_pos):
        rows = y.astype(jnp.float32)
        if weights is not None:  # no FMA with the adds below, as in the kernels
            rows = jax.lax.optimization_barrier(rows * weights[:, None])
        rows = jnp.concatenate([rows, jnp.zeros((1, y.shape[1]), jnp.float32)])
        acc = jnp.zeros((recv_row_pos.shape[0], y.shape[1]), jnp.float32)
        for kk in range(plan.k):  # the destination's rows of each received item, k ascending
            pos = recv_row_pos[:, kk]
            acc = jnp.where((pos >= 0)[:, None], acc + rows[jnp.where(pos >= 0, pos, -1)], acc)
        back = _all_to_all(plan, fast, acc.astype(y.dtype)).reshape(fast.size, -1, y.shape[1])
        out = jnp.zeros((dest.shape[0], y.shape[1]), jnp.float32)
        for p in range(fast.size):  # partials of the distinct destinations, ascending
            to_p = jnp.any(dest == p, axis=1)
            out = jnp.where(to_p[:, None], out + back[p].astype(jnp.float32), out)
        return out.astype(y.dtype)

    def return_row_values(self, plan, fast, values, dest, recv_row_pos):
        padded = jnp.concatenate([values, jnp.zeros(1, jnp.float32)])
        sent = jnp.where(recv_row_pos >= 0, padded[jnp.where(recv_row_pos >= 0, recv_row_pos, -1)],
                         0.0)  # fmt: skip
        back = _all_to_all(plan, fast, sent).reshape(fast.size, -1, plan.k)
        items = jnp.arange(dest.shape[0])[:, None]
        picked = back[jnp.maximum(dest, 0), items, jnp.arange(plan.k)[None, :]]
        return jnp.where(dest >= 0, picked, 0.0)
