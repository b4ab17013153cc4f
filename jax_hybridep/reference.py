"""Dense reference MoE: every token through its top-k experts by einsum (tests and examples).

Global (not per shard): x [N, H], topk_idx [N, K], topk_weights [N, K], expert weights [E, H, F].
Ids outside [0, E) contribute nothing, like the ops' invalid and "-1" ids.
"""

from __future__ import annotations

import jax.numpy as jnp


def routing_matrix(topk_idx, topk_weights, num_experts, kept=None):
    """[N, E] float32: summed routing weight of each expert per token (duplicates add up)."""
    valid = (topk_idx >= 0) & (topk_idx < num_experts)
    if kept is not None:
        valid = valid & kept
    onehot = (topk_idx[..., None] == jnp.arange(num_experts)) & valid[..., None]
    return jnp.einsum("nke,nk->ne", onehot.astype(jnp.float32), topk_weights.astype(jnp.float32))


def dense_moe(x, topk_idx, topk_weights, w, kept=None):
    """sum_k topk_weights[n, k] * (x[n] @ w[topk_idx[n, k]]), computed densely in float32."""
    gates = routing_matrix(topk_idx, topk_weights, w.shape[0], kept)
    per_expert = jnp.einsum("nh,ehf->nef", x.astype(jnp.float32), w.astype(jnp.float32))
    return jnp.einsum("ne,nef->nf", gates, per_expert)
