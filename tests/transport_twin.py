"""Twins of the CUDA transport (xla_ffi/cuda/kernels/transport.h): numpy for its steps, pure JAX
for its exchanges.

The numpy twins compute what the slot-map kernels, the permute, the unpermute and the reduce
compute, written differently (whole-array prefix sums and masks where the reference walks
loops), so tests/cuda_twin_test.py can hold them against the references bit for bit and
against the §2.1 model. `JaxExchanges` has the methods of exchange.cuda.CudaExchanges, built from
the same steps in jnp with `all_to_all` over the fast level's axes, so the GPU route (its bottom,
record and VJPs) runs on fake CPU devices against the xla backend.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_hybridep import fp8
from jax_hybridep.exchange.cuda import SlotMap, padded

# ----------------------------------------------------------------------------- numpy


def numpy_slot_map(gathered: np.ndarray, rank: int, rows: int) -> dict:
    """The slot map of `rank` from the gathered routing [S, M, K, 3] (kernels/slot_map.h)."""
    S, M, K, _ = gathered.shape
    dest, pos = gathered[..., 0], gathered[..., 1]
    weights = gathered[..., 2].copy().view(np.float32)
    goes = np.any(dest[:, :, :, None] == np.arange(S), axis=2).reshape(S * M, S)  # [(s, m), p]
    slot = np.where(goes, np.cumsum(goes, axis=0) - goes, -1)  # dense per p, (s, m) order
    send_slot = np.full((padded(M), S), -1, np.int32)
    send_slot[:M] = slot[rank * M : (rank + 1) * M]
    received = np.flatnonzero(goes[:, rank])  # (s, m) flat, in slot order
    n = received.size
    recv_item = np.full(padded(S * M), -1, np.int32)
    recv_item[:n] = received
    # As the kernels: an entry for this rank at row -1 or >= rows (capacity) has no row.
    row_of = pos.reshape(S * M, K)[received]
    here = (dest.reshape(S * M, K)[received] == rank) & (row_of >= 0) & (row_of < rows)
    recv_rows = np.full((padded(S * M), K), -1, np.int32)
    recv_rows[:n] = np.where(here, pos.reshape(S * M, K)[received], -1)
    row_weights = np.zeros(rows, np.float32)
    row_slot = np.full(rows, -1, np.int32)
    filled = recv_rows[:n] >= 0
    row_weights[recv_rows[:n][filled]] = weights.reshape(S * M, K)[received][filled]
    row_slot[recv_rows[:n][filled]] = np.nonzero(filled)[0]
    last = int(recv_rows[:n][filled].max()) + 1 if filled.any() else 0
    return dict(
        send_slot=send_slot,
        recv_item=recv_item,
        recv_rows=recv_rows,
        row_weights=row_weights,
        row_slot=row_slot,
        info=np.array([n, last], np.int32),
    )


def zero_line(lay: dict, rows: int, zero_pad_multiple: int) -> int:
    """Rows below it that nobody fills are zeroed (LaunchPermute's PaddingFill)."""
    if zero_pad_multiple == 0:
        return rows
    return min(rows, -(-int(lay["info"][1]) // zero_pad_multiple) * zero_pad_multiple)


def numpy_permute(
    slots: np.ndarray,
    lay: dict,
    rows: int,
    zero_pad_multiple: int = 0,
    scale=None,
    fp8_hidden: int = 0,
    dtype=None,
):
    """(rows [C, ...], scaled or None) from the receive buffer `slots` [n, row] (typed rows, or
    with fp8_hidden uint8 FP8 wire rows dequantised to `dtype`); untouched rows are 0xab bytes,
    as the reference leaves them."""
    n = int(lay["info"][0])
    payload = slots[:n]
    if fp8_hidden:
        q, scales = fp8.from_wire(jnp.asarray(payload), fp8_hidden)
        payload = np.asarray(fp8.dequantize(q, scales, jnp.dtype(dtype)))
    width = payload.shape[1:]
    out = (
        np.frombuffer(
            b"\xab" * (rows * payload.dtype.itemsize * int(np.prod(width))), payload.dtype
        )
        .reshape((rows,) + width)
        .copy()
    )
    rows_of = lay["recv_rows"][:n]
    slot_of, k_of = np.nonzero(rows_of >= 0)
    out[rows_of[slot_of, k_of]] = payload[slot_of]
    padding = np.flatnonzero(lay["row_slot"][: zero_line(lay, rows, zero_pad_multiple)] < 0)
    out[padding] = 0
    if scale is None:
        return out, None
    with np.errstate(over="ignore", invalid="ignore"):
        scaled = (out.astype(np.float32) * scale.reshape((-1,) + (1,) * len(width))).astype(
            out.dtype
        )
        scaled[padding] = (np.float32(0) * scale[padding])[:, None].astype(out.dtype)
    untouched = np.ones(rows, bool)
    untouched[rows_of[slot_of, k_of]] = False
    untouched[padding] = False
    scaled[untouched] = out[untouched]  # both 0xab
    return out, scaled


def numpy_unpermute(y: np.ndarray, weights, lay: dict) -> np.ndarray:
    """[n, H] in y's dtype: per received slot its rows of y (times weights) summed in ascending
    k in float32 from +0, rounded once."""
    n = int(lay["info"][0])
    rows_of = lay["recv_rows"][:n]
    acc = np.zeros((n, y.shape[1]), np.float32)
    for k in range(rows_of.shape[1]):
        r = rows_of[:, k]
        v = y[np.maximum(r, 0)].astype(np.float32)
        if weights is not None:
            v = v * weights[np.maximum(r, 0)][:, None]
        acc = np.where((r >= 0)[:, None], acc + v, acc)
    with np.errstate(over="ignore"):
        return acc.astype(y.dtype)


def numpy_reduce(partials: np.ndarray, dest: np.ndarray) -> np.ndarray:
    """[M, H]: per item the partials [S, M, H] of its distinct destinations added in ascending
    order in float32 from +0, rounded once."""
    S, M = partials.shape[:2]
    acc = np.zeros(partials.shape[1:], np.float32)
    for d in range(S):
        here = np.any(dest == d, axis=1)
        acc = np.where(here[:, None], acc + partials[d].astype(np.float32), acc)
    with np.errstate(over="ignore"):
        return acc.astype(partials.dtype)


# ----------------------------------------------------------------------------- JAX


def _all_to_all(plan, fast, a):
    return jax.lax.all_to_all(a, plan.topology.levels[fast.level], 0, 0, tiled=True)


def _padded_rows(a):
    """a with one extra zero row at the end: index -1 reads it."""
    return jnp.concatenate([a, jnp.zeros((1,) + a.shape[1:], a.dtype)])


class JaxExchanges:
    """CudaExchanges in jnp: the slot map as numpy_slot_map, each exchange an all_to_all into the
    receivers' dense slots (or the sources' partial slots), the row steps as the kernels'."""

    def slot_map(self, plan, fast, gathered):
        size, items, k = gathered.shape[:3]
        rank = fast.coord
        dest, pos = gathered[..., 0], gathered[..., 1]
        weights = jax.lax.bitcast_convert_type(gathered[..., 2], jnp.float32)
        goes = jnp.any(dest[:, :, :, None] == jnp.arange(size), axis=2).reshape(size * items, size)
        slot = jnp.where(goes, jnp.cumsum(goes, axis=0, dtype=jnp.int32) - goes, -1)
        mine = jax.lax.dynamic_slice_in_dim(slot, rank * items, items)
        send_slot = jnp.full((padded(items), size), -1, jnp.int32).at[:items].set(mine)
        to_me = goes[:, rank]
        j = jnp.where(to_me, jnp.cumsum(to_me, dtype=jnp.int32) - 1, padded(size * items))
        n = jnp.sum(to_me, dtype=jnp.int32)
        flat = jnp.arange(size * items, dtype=jnp.int32)
        recv_item = jnp.full(padded(size * items) + 1, -1, jnp.int32).at[j].set(flat)[:-1]
        # As the kernels: an entry for this rank at row -1 or >= rows (capacity) has no row.
        row_of = pos.reshape(-1, k)
        here = (dest.reshape(-1, k) == rank) & (row_of >= 0) & (row_of < plan.rows)
        rows_here = jnp.where(here, row_of, -1)
        recv_rows = jnp.full((padded(size * items) + 1, k), -1, jnp.int32).at[j].set(rows_here)
        recv_rows = recv_rows[:-1]
        target = jnp.where(rows_here >= 0, rows_here, plan.rows).reshape(-1)
        row_weights = (
            jnp.zeros(plan.rows + 1, jnp.float32).at[target].set(weights.reshape(-1))[: plan.rows]
        )
        row_slot = (
            jnp.full(plan.rows + 1, -1, jnp.int32).at[target].set(jnp.repeat(j, k))[: plan.rows]
        )
        last = jnp.max(jnp.where(rows_here >= 0, rows_here + 1, 0), initial=0)
        info = jnp.stack([n, last]).astype(jnp.int32)
        return SlotMap(send_slot, recv_item, recv_rows, row_slot, info), row_weights

    def _receive(self, plan, fast, x, lay):
        """[padded(S * M), ...]: this GPU's dense receive buffer after every source's send."""
        size, items = lay.send_slot.shape[1], x.shape[0]
        slots = lay.recv_rows.shape[0]
        # Source side: per peer p, x's rows at their slots there (the rest zero).
        at = jnp.where(lay.send_slot[:items] >= 0, lay.send_slot[:items], slots).T  # [S, M]
        outgoing = jax.vmap(lambda a: jnp.zeros((slots + 1,) + x.shape[1:], x.dtype).at[a].set(x))(
            at
        )[:, :slots]
        incoming = _all_to_all(plan, fast, outgoing).reshape((size, slots) + x.shape[1:])
        # Each slot is written by one source: select it (sums would turn -0 into +0).
        source = jnp.where(lay.recv_item >= 0, lay.recv_item // items, 0)
        return incoming[source, jnp.arange(slots)]

    def _permute(self, plan, lay, payload, scale=None):
        rows_of = lay.recv_rows
        target = jnp.where(rows_of >= 0, rows_of, plan.rows).reshape(-1)
        values = jnp.repeat(payload, rows_of.shape[1], axis=0)
        out = jnp.zeros((plan.rows + 1,) + payload.shape[1:], payload.dtype)
        out = out.at[target].set(values)[: plan.rows]
        if scale is None:
            return out
        scaled = (out.astype(jnp.float32) * scale[:, None]).astype(out.dtype)
        return out, scaled

    def dispatch(self, plan, fast, x, lay, form):
        if form.quantiser == "send":  # the send kernel quantises
            x = fp8.to_wire(*fp8.quantize(x))
        rows = self._permute(plan, lay, self._receive(plan, fast, x, lay))
        if form.fp8_hidden and not form.fp8_rows:  # the permute dequantises
            rows = fp8.dequantize(*fp8.from_wire(rows, plan.hidden), plan.row_dtype)
        return rows

    def redispatch(self, plan, fast, g, lay, scale=None):
        return self._permute(plan, lay, self._receive(plan, fast, g, lay), scale)

    def unpermute(self, plan, fast, y, weights, lay):
        rows = y.astype(jnp.float32)
        if weights.weighted:  # no FMA with the adds below, as in the kernels
            rows = jax.lax.optimization_barrier(rows * weights.values[:, None])
        rows = _padded_rows(rows)
        acc = jnp.zeros((lay.recv_rows.shape[0], y.shape[1]), jnp.float32)
        for kk in range(lay.recv_rows.shape[1]):  # ascending k
            r = lay.recv_rows[:, kk]
            acc = jnp.where((r >= 0)[:, None], acc + rows[r], acc)
        return acc.astype(y.dtype)

    def combine(self, plan, fast, partials, lay, dest):
        size, items = fast.size, dest.shape[0]
        # Destination side: slot j's partial to its source at [this GPU, item].
        target = jnp.where(lay.recv_item >= 0, lay.recv_item, size * items)
        outgoing = jnp.zeros((size * items + 1, partials.shape[1]), partials.dtype)
        outgoing = outgoing.at[target].set(partials)[: size * items]
        back = _all_to_all(plan, fast, outgoing).reshape(size, items, -1)  # [d, m]
        out = jnp.zeros((items, partials.shape[1]), jnp.float32)
        for d in range(size):  # the distinct destinations in ascending order
            here = jnp.any(dest == d, axis=1)
            out = jnp.where(here[:, None], out + back[d].astype(jnp.float32), out)
        return out.astype(partials.dtype)
