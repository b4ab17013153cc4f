"""Baselines: dispatch + combine written the way JAX users write them today.

Each is a per-shard function `(x [T, H], topk_idx [T, K], topk_weights [T, K]) -> (out [T, H],
dropped [])` for use inside `jax.shard_map` over the EP axes `axes`, computing the same math as
`hep.combine(hep.dispatch(...).tokens, handle, weights=d.weights)` with identity experts:
`out[t] = sum over kept k of w[t, k] * x[t]`. Expert e lives on EP rank `e // E_local`.

* `gshard`: GShard/Praxis one-hot dispatch mask `[T, E, cap]` (positions by a cumsum over
  (k, t), so first choices win), einsum to `[E, cap, H]`, dense `all_to_all`, back, combine
  einsum. Capacity per (source rank, expert) `ceil(f * T * K / E)`; drops over it.
* `maxtext`: tokens expanded ×K, sorted by expert, exchanged with `ragged_all_to_all` (GPU) or,
  where XLA lacks it (CPU), a padded dense `all_to_all` of worst-case `T*K` rows per destination;
  back the same way, unsorted and summed with the weights. Dropless.
* `worst_case`: a plain dense `all_to_all` of `[R, T, H]` (every token to every rank that holds
  one of its experts, zero rows elsewhere), back, weighted sum. Dropless.

`buffer_rows` gives each baseline's static exchange size (rows per rank, one direction).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

METHODS = ("gshard", "maxtext", "worst_case")


def gshard_capacity(f: float, tokens: int, top_k: int, experts: int) -> int:
    return max(1, math.ceil(f * tokens * top_k / experts))


def buffer_rows(method: str, *, tokens, top_k, experts, ranks, capacity_factor=None, ragged=False):
    """Rows one rank sends in one direction (its send buffer), padding included."""
    if method == "gshard":
        return experts * gshard_capacity(capacity_factor, tokens, top_k, experts)
    if method == "maxtext":
        return tokens * top_k if ragged else ranks * tokens * top_k
    if method == "worst_case":
        return ranks * tokens
    raise ValueError(method)


def _a2a(v, axes):
    return jax.lax.all_to_all(v, axes, 0, 0, tiled=True)


def make_gshard(axes, ranks: int, experts: int, capacity_factor: float):
    def fn(x, idx, w):
        t, k = idx.shape
        h = x.shape[1]
        cap = gshard_capacity(capacity_factor, t, k, experts)
        onehot = jax.nn.one_hot(idx.T.reshape(-1), experts, dtype=jnp.int32)  # [(k, t), E]
        pos = (jnp.cumsum(onehot, axis=0) - 1) * onehot
        pos = jnp.sum(pos, axis=-1).reshape(k, t).T  # [T, K] slot within the expert
        keep = (pos < cap) & (idx >= 0)
        slot = jax.nn.one_hot(jnp.where(keep, pos, cap), cap, dtype=x.dtype)  # [T, K, cap]
        expert = jax.nn.one_hot(idx, experts, dtype=x.dtype)  # [T, K, E]
        mask = jnp.einsum("tke,tkc->tec", expert, slot)  # [T, E, cap] dispatch mask
        comb = jnp.einsum("tke,tkc,tk->tec", expert, slot, w.astype(x.dtype))
        sent = jnp.einsum("tec,th->ech", mask, x)  # [E, cap, H]
        recv = _a2a(sent.reshape(ranks, -1, h), axes)  # [R(src), E_local*cap, H]
        y = recv  # identity experts
        back = _a2a(y, axes).reshape(experts, cap, h)
        out = jnp.einsum("tec,ech->th", comb, back)
        dropped = jnp.sum(~keep & (idx >= 0)).astype(jnp.int32)
        return out, dropped

    return fn


def _sorted_layout(idx, ranks: int, experts: int):
    """Expanded rows sorted by expert: order, destination rank and slot per sorted row."""
    t, k = idx.shape
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # [T*K] expanded row of each sorted position
    dest = flat[order] // (experts // ranks)
    counts = jnp.zeros(ranks, jnp.int32).at[dest].add(1)
    starts = jnp.cumsum(counts) - counts
    slot = jnp.arange(t * k, dtype=jnp.int32) - starts[dest]
    return order, dest, counts, starts, slot


def make_maxtext(axes, ranks: int, experts: int, ragged: bool):
    def fn(x, idx, w):
        t, k = idx.shape
        h = x.shape[1]
        order, dest, counts, starts, slot = _sorted_layout(idx, ranks, experts)
        rows = x[order // k]  # [T*K, H] expanded and sorted
        if ragged:
            # Receivers lay sources out in rank order, each in a worst-case T*K window.
            recv_counts = _a2a(counts, axes)  # rows each source sends here
            recv_starts = _a2a(starts, axes)  # where each source keeps them (for the way back)
            me = jax.lax.axis_index(axes)
            out_off = jnp.full(ranks, me * t * k, jnp.int32)
            buf = jnp.zeros((ranks * t * k, h), x.dtype)
            recv = jax.lax.ragged_all_to_all(
                rows, buf, starts, counts, out_off, recv_counts, axis_name=axes
            )
            y = recv  # identity experts
            src_off = jnp.arange(ranks, dtype=jnp.int32) * t * k
            back = jax.lax.ragged_all_to_all(
                y, jnp.zeros_like(rows), src_off, recv_counts, recv_starts, counts, axis_name=axes
            )
            y_sorted = back
        else:
            send = jnp.zeros((ranks, t * k, h), x.dtype).at[dest, slot].set(rows)
            recv = _a2a(send, axes)  # [R(src), T*K, H]
            y = recv  # identity experts
            back = _a2a(y, axes)
            y_sorted = back[dest, slot]
        y_exp = jnp.zeros_like(y_sorted).at[order].set(y_sorted).reshape(t, k, h)
        out = jnp.einsum("tkh,tk->th", y_exp.astype(jnp.float32), w.astype(jnp.float32))
        return out.astype(x.dtype), jnp.zeros((), jnp.int32)

    return fn


def make_worst_case(axes, ranks: int, experts: int):
    def fn(x, idx, w):
        dest = idx // (experts // ranks)  # [T, K]
        onehot = jax.nn.one_hot(dest, ranks, dtype=jnp.float32)  # [T, K, R]
        present = jnp.max(onehot, axis=1).T  # [R, T]
        rank_w = jnp.einsum("tkr,tk->tr", onehot, w.astype(jnp.float32))  # [T, R]
        send = x[None] * present[..., None].astype(x.dtype)  # [R, T, H]
        recv = _a2a(send, axes)
        y = recv  # identity experts
        back = _a2a(y, axes)  # [R, T, H]
        out = jnp.einsum("rth,tr->th", back.astype(jnp.float32), rank_w)
        return out.astype(x.dtype), jnp.zeros((), jnp.int32)

    return fn


def make(method: str, axes, ranks: int, experts: int, capacity_factor=None, ragged=False):
    """The per-shard function of baseline `method`."""
    if method == "gshard":
        return make_gshard(axes, ranks, experts, capacity_factor)
    if method == "maxtext":
        return make_maxtext(axes, ranks, experts, ragged)
    if method == "worst_case":
        return make_worst_case(axes, ranks, experts)
    raise ValueError(f"unknown baseline {method!r}; one of {METHODS}")
