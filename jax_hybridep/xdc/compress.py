"""SR compression of migrated experts (HybridEP's parameter-efficient migration).

Each layer keeps a shared expert: the mean of the domain's experts, recomputed every call by an
all-reduce over the inner axes (so every member of a domain decodes against the same one). An
expert travels as the top-k entries, by magnitude, of its residual (expert - shared) in
value-index form: k values in the weights' dtype and k int32 indices per matrix, with
`k = max(1, floor(n * value_bytes / (compression * (value_bytes + 4))))` for a matrix of n entries,
so `compression` is full bytes / bytes sent (`wire`). The receiver decodes shared + scatter(values
at indices); a rank's own experts stay exact.

Gradients are straight-through to the owner's full weights: the backward pass treats each decoded
replica as if it were the owner's exact expert, so the replicas' gradients are reduce-scattered
back to the owner exactly as without compression (the transpose of an uncompressed all-gather).
The shared expert gets no gradient (it is a function of the experts, not a parameter).

Per shard, inside `jax.shard_map`; the inner axes are the domain axes, slow -> fast.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_hybridep.xdc import wire


def kept_entries(num_entries: int, dtype, compression: float | None) -> int:
    """k: entries of one matrix sent at SR compression `compression` (all of them when None)."""
    if compression is None:
        return num_entries
    return wire.topk_count(num_entries, compression, np.dtype(dtype).itemsize)


def sent_bytes(matrix_shape, dtype, compression: float | None) -> int:
    """Bytes one expert matrix of `matrix_shape` costs on the wire."""
    n, value_bytes = math.prod(matrix_shape), np.dtype(dtype).itemsize
    if compression is None:
        return n * value_bytes
    return kept_entries(n, dtype, compression) * (value_bytes + wire.INDEX_BYTES)


def gather_compressed(weights, axes: tuple[str, ...], compression: float):
    """[E_local, ...] per matrix -> [S * E_local, ...]: the domain's experts, SR-compressed.

    Slot order is that of sequential all-gathers over `axes` (slow -> fast); the rank's own
    block holds its exact weights.
    """
    return _gather(tuple(weights), axes, float(compression))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gather(weights, axes, compression):
    return tuple(_gather_one(w, axes, compression) for w in weights)


def _gather_fwd(weights, axes, compression):
    return _gather(weights, axes, compression), None


def _gather_bwd(axes, compression, _, cotangents):
    del compression
    grads = []
    for ct in cotangents:
        for axis in reversed(axes):  # the transpose of the slow -> fast all-gathers
            ct = jax.lax.psum_scatter(ct, axis, scatter_dimension=0, tiled=True)
        grads.append(ct)
    return (tuple(grads),)


_gather.defvjp(_gather_fwd, _gather_bwd)


def shared_expert(w, axes):
    """The domain's mean expert [...] from this rank's [E_local, ...] (same on every member)."""
    shared = jnp.mean(w.astype(jnp.float32), axis=0).astype(w.dtype)
    for axis in axes:  # one all-reduce per level, so each is counted on its own link
        shared = jax.lax.pmean(shared, axis)
    return shared


def _gather_one(w, axes, compression):
    e_local, shape = w.shape[0], w.shape[1:]
    n = math.prod(shape)
    shared = shared_expert(w, axes).reshape(n)
    residual = w.reshape(e_local, n) - shared
    _, index = jax.lax.top_k(jnp.abs(residual), kept_entries(n, w.dtype, compression))
    values = jnp.take_along_axis(residual, index, axis=1)
    block, held = 0, 1
    for axis in axes:
        values = jax.lax.all_gather(values, axis, tiled=True)
        index = jax.lax.all_gather(index, axis, tiled=True)
        block = jax.lax.axis_index(axis) * held + block
        held *= jax.lax.axis_size(axis)
    rows = jnp.arange(values.shape[0])[:, None]
    decoded = jnp.broadcast_to(shared, (values.shape[0], n)).at[rows, index].add(values)
    decoded = decoded.reshape(values.shape[0], *shape)
    # Own experts stay exact: only replicas pay for compression.
    return jax.lax.dynamic_update_slice_in_dim(decoded, w, block * e_local, axis=0)
