"""What travels when experts migrate inside a domain (the settings are `xdc.Migration`), and the
top-k value-index code that SR compression and gradient compression share (per shard, JAX).

SR compression (HybridEP's parameter-efficient migration) sends each migrated expert as the top-k
entries, by magnitude, of its residual from a reference expert, per matrix, in value-index form:
`k = max(1, floor(n * value_bytes / (ratio * (value_bytes + 4))))` values in the weights' dtype and
k int32 indices for a matrix of n entries, so `ratio` is full bytes / bytes sent (`wire`). The
receiver decodes reference + scatter(values at indices). The reference (`Migration.shared`):

* "persistent" (the paper's, the default): one shared expert per layer, initialised as the mean of
  the layer's experts and kept as state; every `sync_every` steps it is refreshed to the mean of
  the current experts by an all-reduce whose result is used from the next step on, so nothing in
  the step waits for it. Between refreshes it is stale: what is decoded is not a function of the
  current experts alone (not exact, as no SR is).
* "mean": the mean of the domain's experts, recomputed every step by an all-reduce over the
  domain before the gather (on the critical path).
* "none": no reference, the top-k of the weights themselves (the paper's "w/o shared expert"
  ablation).

Decoding is lossless exactly when a residual has at most k nonzero entries per matrix (then values
and gradients equal plain EP's); otherwise SR is lossy. Gradients are straight-through: each
decoded replica is treated as its owner's exact expert.

Gradient compression (`Migration.grad_compression`, opt-in, not exact): the replicas' gradients
return to their owners as the top-k (same k rule) of gradient + error-feedback residual; what is
not sent stays in the sender's residual and is added to the next step's gradient, so over steps
every gradient entry is eventually delivered (the sum delivered plus the residual left equals the
sum of the true gradients).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_hybridep.values import check_int


def top_k(rows, k: int):
    """(values, int32 indices) of the k entries of largest magnitude of each row [..., n]."""
    check_int("k", k, 1, jnp.shape(rows)[-1], what=f"an int in [1, n={jnp.shape(rows)[-1]}]")
    _, index = jax.lax.top_k(jnp.abs(rows), k)
    return jnp.take_along_axis(rows, index, axis=-1), index.astype(jnp.int32)


def scatter_rows(base, values, index):
    """base [R, n] + values [R, k] added at `index` [R, k] (rows decoded from value-index form)."""
    rows = jnp.arange(values.shape[0])[:, None]
    return base.at[rows, index].add(values.astype(base.dtype))
