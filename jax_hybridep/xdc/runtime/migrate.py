"""Expert migration per shard, inside `jax.shard_map`: the domain's all-gather of experts and its
transpose, the reduce-scatter of the replicas' gradients to their owners (`compress` for what
travels).

Every collective is fused over all the matrices it is given: one all-gather (one all-to-all for
compressed gradients) per inner axis and element type, however many matrices and layers. A block
passes its own three matrices; a model that prefetches (`ExpertDomains.gather_experts` on every
layer's matrices at once) moves all its layers' experts in one collective per axis at step start.

The inner axes are the domain axes, slow -> fast; gathers run in that order (across datacenters
only each rank's own experts travel) and reduce-scatters in the reverse one. After the gathers a
rank holds `S * E` slots per matrix (`S` = product of the inner sizes): the members' blocks in
the order of the sequential gathers, its own block exact.

Autodiff: full experts without gradient compression are plain collectives (the all-gather's
transpose is the reduce-scatter: exact). Otherwise `jax.custom_vjp`: straight-through gradients
(SR), and with gradient compression the error-feedback residuals enter as an input whose
cotangent is their next value (`jax_hybridep.nn.value_and_grad` hands it back as state).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jax_hybridep import compat
from jax_hybridep.values import check_int, check_ints, check_type
from jax_hybridep.xdc.expert_wire import kept_entries
from jax_hybridep.xdc.migration import Migration
from jax_hybridep.xdc.runtime.compress import scatter_rows, top_k

GATHER_SCOPE = "xdc_gather"  # named scopes, so op_names tell the migration's collectives apart
SCATTER_SCOPE = "xdc_grad_scatter"
REFRESH_SCOPE = "xdc_sr_refresh"


# -- fused collectives ------------------------------------------------------------------------


def _by_dtype(arrays):
    """{dtype: [indices of arrays of that dtype]} in first-seen order."""
    groups: dict = {}
    for i, a in enumerate(arrays):
        groups.setdefault(jnp.dtype(a.dtype), []).append(i)
    return groups


def _fused_all_gather(arrays, axis):
    """Each [B, ...] -> [S * B, ...] (member-major), one all-gather per element type."""
    out = [None] * len(arrays)
    for idx in _by_dtype(arrays).values():
        flat = jnp.concatenate([arrays[i].reshape(-1) for i in idx])
        held = jax.lax.all_gather(flat, axis)  # [S, N]
        start = 0
        for i in idx:
            a = arrays[i]
            piece = held[:, start : start + a.size]
            start += a.size
            out[i] = piece.reshape(held.shape[0] * a.shape[0], *a.shape[1:])
    return out


def _fused_reduce_scatter(arrays, axis):
    """Each [S * B, ...] -> [B, ...]: member j's block summed over members, onto member j."""
    size = jax.lax.axis_size(axis)
    out = [None] * len(arrays)
    for idx in _by_dtype(arrays).values():
        flat = jnp.concatenate([arrays[i].reshape(size, -1) for i in idx], axis=1)
        mine = jax.lax.psum_scatter(flat, axis, scatter_dimension=0)  # [N]
        start = 0
        for i in idx:
            a = arrays[i]
            n = a.size // size
            out[i] = mine[start : start + n].reshape(a.shape[0] // size, *a.shape[1:])
            start += n
    return out


def _fused_all_to_all(arrays, axis):
    """Each [S, ...]: row j goes to member j; returns [S, ...] with row j from member j."""
    out = [None] * len(arrays)
    size = jax.lax.axis_size(axis)
    for idx in _by_dtype(arrays).values():
        flat = jnp.concatenate([arrays[i].reshape(size, -1) for i in idx], axis=1)
        got = jax.lax.all_to_all(flat, axis, 0, 0)
        start = 0
        for i in idx:
            n = arrays[i].size // size
            out[i] = got[:, start : start + n].reshape(arrays[i].shape)
            start += n
    return out


def _own_block(axes) -> tuple[jax.Array, int]:
    """(index of this rank's block among the S blocks after the gathers over `axes`, S)."""
    block, held = 0, 1
    for axis in axes:
        block = jax.lax.axis_index(axis) * held + block
        held *= jax.lax.axis_size(axis)
    return block, held


# -- the reference (SR) -----------------------------------------------------------------------


def domain_mean(w, axes):
    """The domain's mean expert [...] from this rank's [E, ...] (the same on every member)."""
    axes = _axes("axes", axes, allow_empty=True)
    ref = jnp.mean(w.astype(jnp.float32), axis=0).astype(w.dtype)
    for axis in axes:  # one all-reduce per level, so each is counted on its own link
        ref = jax.lax.pmean(ref, axis)
    return ref


def refresh(weights: Sequence[jax.Array], reference, step, every: int, ep_axes):
    """The persistent shared experts to use after this step: every `every` steps (when
    `(step + 1) % every == 0`) the mean of all experts, by an all-reduce over `ep_axes` (every
    rank holds as many experts); else `reference` unchanged. Gradients do not flow into it."""
    check_int("every", every, 1)
    weights = [jax.lax.stop_gradient(w) for w in weights]

    def fresh():
        with jax.named_scope(REFRESH_SCOPE):
            local = [jnp.mean(w.astype(jnp.float32), axis=0) for w in weights]
            return tuple(
                jax.lax.pmean(m, tuple(ep_axes)).astype(r.dtype)
                for m, r in zip(local, reference, strict=True)
            )

    return jax.lax.cond((step + 1) % every == 0, fresh, lambda: tuple(reference))


# -- the gather ------------------------------------------------------------------------------


def gather(
    weights: Sequence[jax.Array],
    axes: tuple[str, ...],
    migration: Migration,
    reference: Sequence[jax.Array] = (),
    feedback: Sequence[Sequence[jax.Array]] = (),
) -> tuple[jax.Array, ...]:
    """[E_i, ...] per matrix -> [S * E_i, ...]: the domain's experts, as `migration` sends them.

    Args:
      weights: this rank's experts, one array per matrix (any layers).
      axes: the inner axes, slow -> fast (non-empty).
      migration: what travels; compression needs `reference` when shared="persistent".
      reference: per matrix, the persistent shared expert [...] (the same on every rank).
      feedback: with gradient compression, per axis (in `axes` order) per matrix, the
        error-feedback residual of shape `feedback_shapes(...)`.
    """
    check_type("migration", migration, Migration, "an xdc.Migration")
    axes = _axes("axes", axes)
    if isinstance(weights, str) or not isinstance(weights, Sequence):
        raise TypeError(f"weights must be a sequence of arrays (one per matrix), got {weights!r}")
    weights = tuple(weights)
    if migration.exact:
        with jax.named_scope(GATHER_SCOPE):
            for axis in axes:
                weights = tuple(_fused_all_gather(weights, axis))
        return weights
    if migration.persistent and len(reference) != len(weights):
        raise ValueError(
            f"SR with a persistent shared expert needs one reference per matrix: got "
            f"{len(reference)} for {len(weights)} matrices"
        )
    if migration.grad_compression is not None and len(feedback) != len(axes):
        raise ValueError(
            f"gradient compression needs error-feedback residuals for each of the {len(axes)} "
            f"inner axes {axes}, got {len(feedback)}"
        )
    reference = tuple(reference) if migration.persistent else ()
    feedback = tuple(tuple(f) for f in feedback) if migration.grad_compression else ()
    return _migrate(weights, reference, feedback, axes, migration)


def _axes(name: str, axes, allow_empty: bool = False) -> tuple[str, ...]:
    """axes as a tuple of mesh axis names (a bare name is one axis)."""
    axes = (axes,) if isinstance(axes, str) else axes
    if not isinstance(axes, Sequence) or not all(isinstance(a, str) for a in axes):
        raise TypeError(f"{name} must be mesh axis names, got {axes!r}")
    if not axes and not allow_empty:
        raise ValueError(f"{name} must name at least one inner axis")
    return tuple(axes)


def feedback_shapes(shapes: Sequence[tuple[int, ...]], sizes: Sequence[int]):
    """Per inner axis (sizes `S_i`, slow -> fast), per matrix of per-shard shape [E, ...], the
    per-shard shape of its error-feedback residual: the gradient entering that axis's
    reduce-scatter, `[prod_{m <= i} S_m * E, ...]`."""
    sizes = check_ints("sizes", sizes, 1, min_len=0)
    shapes = [check_ints("shapes[i]", s, 0) for s in shapes]
    out, held = [], 1
    for size in sizes:
        held *= size
        out.append(tuple((held * s[0], *s[1:]) for s in shapes))
    return tuple(out)


def _encode(w, ref, ratio):
    """(values, indices) [E, k] of the top-k residual of w [E, ...] from ref [...] (None: 0)."""
    rows = w.reshape(w.shape[0], -1)
    if ref is not None:
        rows = rows - ref.reshape(-1).astype(rows.dtype)
    return top_k(rows, kept_entries(rows.shape[1], w.dtype, ratio))


def _forward(weights, reference, axes, migration):
    if migration.compression is None:
        for axis in axes:
            weights = tuple(_fused_all_gather(weights, axis))
        return weights
    if migration.shared == "persistent":
        refs = reference
    elif migration.shared == "mean":
        refs = tuple(domain_mean(w, axes) for w in weights)
    else:
        refs = (None,) * len(weights)
    codes = [_encode(w, r, migration.compression) for w, r in zip(weights, refs, strict=True)]
    parts = [a for code in codes for a in code]  # values and indices, gathered together
    for axis in axes:
        parts = _fused_all_gather(parts, axis)
    block, held = _own_block(axes)
    out = []
    for i, (w, ref) in enumerate(zip(weights, refs, strict=True)):
        values, index = parts[2 * i], parts[2 * i + 1]
        n = math.prod(w.shape[1:])
        base = jnp.zeros((values.shape[0], n), w.dtype) if ref is None else ref.reshape(1, n)
        base = compat.mark_varying(jnp.broadcast_to(base, (values.shape[0], n)), axes)
        decoded = scatter_rows(base, values, index).reshape(held * w.shape[0], *w.shape[1:])
        # Own experts stay exact: only replicas pay for compression.
        out.append(jax.lax.dynamic_update_slice_in_dim(decoded, w, block * w.shape[0], axis=0))
    return tuple(out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _migrate(weights, reference, feedback, axes, migration):
    with jax.named_scope(GATHER_SCOPE):
        return _forward(weights, reference, axes, migration)


def _migrate_fwd(weights, reference, feedback, axes, migration):
    return _migrate(weights, reference, feedback, axes, migration), (reference, feedback)


def _migrate_bwd(axes, migration, saved, cotangents):
    reference, feedback = saved
    cts = list(cotangents)
    new_feedback = [None] * len(feedback)
    with jax.named_scope(SCATTER_SCOPE):
        for i in reversed(range(len(axes))):  # the transpose of the slow -> fast gathers
            if migration.grad_compression is None:
                cts = _fused_reduce_scatter(cts, axes[i])
            else:
                cts, new_feedback[i] = _compressed_reduce_scatter(
                    cts, feedback[i], axes[i], migration.grad_compression
                )
    ref_ct = tuple(jnp.zeros_like(r) for r in reference)  # state, not a parameter
    return tuple(cts), ref_ct, tuple(tuple(f) for f in new_feedback)


_migrate.defvjp(_migrate_fwd, _migrate_bwd)


def _compressed_reduce_scatter(cts, feedback, axis, ratio):
    """`_fused_reduce_scatter` with each block for another member sent as the top-k of
    gradient + residual; returns (summed blocks [B, ...], next residuals [S * B, ...])."""
    size = jax.lax.axis_size(axis)
    own = jax.lax.axis_index(axis)
    others = (jnp.arange(size) != own)[:, None, None]  # [S, 1, 1]
    sends, exact, residuals = [], [], []
    for ct, fb in zip(cts, feedback, strict=True):
        block = ct.shape[0] // size
        acc = (ct + fb.astype(ct.dtype)).reshape(size, block, -1)  # [S, B, n]
        values, index = top_k(acc, kept_entries(acc.shape[-1], ct.dtype, ratio))
        sent = (
            jnp.zeros_like(acc)
            .at[jnp.arange(size)[:, None, None], jnp.arange(block)[None, :, None], index]
            .set(values)
        )
        residuals.append(jnp.where(others, acc - sent, 0).reshape(ct.shape).astype(fb.dtype))
        exact.append(jax.lax.dynamic_index_in_dim(acc, own, keepdims=False))  # [B, n]
        sends += [jnp.where(others, values, 0), index]
    got = _fused_all_to_all(sends, axis)
    out = []
    for i, (ct, mine) in enumerate(zip(cts, exact, strict=True)):
        values, index = got[2 * i], got[2 * i + 1]  # [S, B, k] from each member
        block = mine.shape[0]
        rows = jnp.swapaxes(values, 0, 1).reshape(block, -1)  # [B, S * k]
        summed = scatter_rows(mine, rows, jnp.swapaxes(index, 0, 1).reshape(block, -1))
        out.append(summed.reshape(block, *ct.shape[1:]))
    return out, residuals
