"""Switch/GShard capacity inside the router: each token group's rows per expert are capped.

An opt-in alternative to the dispatch's own capacity (docs/design.md §2.1.3, per local expert over
the whole EP group in (source rank, t, k) order). Here the tokens are cut into groups (a sequence,
or a shard's tokens), and inside a group every expert keeps its first `cap` rows in **k-major**
order: every token's first choice, in token order, before any token's second choice (GShard,
NLLB-MoE, Switch with k = 1). A dropped (t, k) becomes id -1 with weight 0 before dispatch, so
dispatch sees an ordinary routing and its contract is unchanged: it never makes a row for it.

Everything here is per token group; nothing crosses devices.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def group_capacity(config, tokens_per_group: int) -> int:
    """Rows each expert may take per group: `group_capacity`, or
    `top_k * ceil(group_capacity_factor * tokens_per_group / num_experts)`."""
    if config.group_capacity is not None:
        return config.group_capacity
    per_choice = math.ceil(config.group_capacity_factor * tokens_per_group / config.num_experts)
    return config.top_k * per_choice


def _positions_k_major(ids):
    """ids [M] (one group, k-major) -> [M] int32: how many earlier entries share the id."""
    m = ids.shape[0]
    order = jnp.argsort(ids, stable=True)  # equal ids keep their k-major order
    sorted_ids = ids[order]
    first = jnp.searchsorted(sorted_ids, sorted_ids, side="left").astype(jnp.int32)
    rank = jnp.arange(m, dtype=jnp.int32) - first
    return jnp.zeros(m, jnp.int32).at[order].set(rank)


def keep_mask(topk_idx, config, group_size: int | None):
    """Which (t, k) fit their expert's capacity in their group.

    Args:
      topk_idx: [N, K] int32 expert ids (all valid), tokens in group order.
      config: the RouterConfig (group_capacity or group_capacity_factor set).
      group_size: tokens per group (N must be a multiple); None: all N tokens form one group.

    Returns:
      [N, K] bool.
    """
    n, k = topk_idx.shape
    g = n if group_size is None else group_size
    if g < 1 or n % g:
        raise ValueError(
            f"router group capacity: {n} tokens do not split into groups of {g} tokens "
            "(each device must hold whole token groups; with token_group='sequence' a group is "
            "the block input's second-to-last axis)"
        )
    cap = group_capacity(config, g)
    k_major = topk_idx.reshape(n // g, g, k).transpose(0, 2, 1).reshape(n // g, k * g)
    position = jax.vmap(_positions_k_major)(jax.lax.stop_gradient(k_major))
    kept = position < cap
    return kept.reshape(n // g, k, g).transpose(0, 2, 1).reshape(n, k)
