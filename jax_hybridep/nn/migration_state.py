"""Cross-DC expert migration for the Flax MoE block: its state (made by `init_state`), the gather
(per block or prefetched for a whole model at step start), and a `value_and_grad` that keeps the
gradient compression's error feedback.

State a block with expert domains may hold (`xdc.Migration` says which):
* `SRReference` variables: the persistent SR shared expert (one per matrix, replicated) and the
  step count that times its refresh; updated by `MoEBlock.update_state` from `MoEAux.sr_shared`.
* `GradFeedback` variables: the error-feedback residuals of the compressed gradient
  reduce-scatter, one per inner axis and matrix, each device its own (sharded over every mesh
  axis). Their "gradient" is their next value: train with `value_and_grad` below, which returns
  them as state instead of as gradients.

Sharding model: the gathered replicas are global `[S * E, ...]` arrays sharded over the split
mesh's `expert_axes` (each shard a rank's `S * E_local` slots), passed from the gather's
`shard_map` to the block's without moving.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jax_hybridep.pytree import pytree_record
from jax_hybridep.values import check_bool
from jax_hybridep.xdc.runtime import migrate


class SRReference(nnx.Variable):
    """The persistent SR shared expert (or its refresh clock): state, not a parameter."""


class GradFeedback(nnx.Variable):
    """Error-feedback residual of the compressed gradient reduce-scatter (one device's own)."""


@pytree_record
@dataclasses.dataclass(frozen=True)
class Gathered:
    """A block's experts after the domain gather, and what its persistent SR state becomes.

    Attributes:
      weights: (w_gate, w_up, w_down) replicas, global [S * E, ...] over the split mesh.
      sr_shared: the shared expert per matrix to keep after this step (None without one).
    """

    weights: tuple[jax.Array, ...]
    sr_shared: tuple[jax.Array, ...] | None = None


def init_state(block) -> None:
    """Gives `block` the state its domains' migration keeps: a persistent SR shared expert (the
    mean of the experts) and its clock; error-feedback residuals (zero), each device its own."""
    d = block.domains
    if d is None or not d.inner_axes:  # every domain of size 1: plain EP, nothing migrates
        return
    weights = block.expert_weights()
    if d.migration.persistent:
        block.sr_reference = nnx.List([SRReference(jnp.mean(w[...], axis=0)) for w in weights])
        block.sr_clock = SRReference(jnp.zeros((), jnp.int32))
    if d.migration.grad_compression is not None:
        mesh = block.mesh
        shards, axes = mesh.devices.size, tuple(mesh.axis_names)  # each device its own residuals
        local = [(w.shape[0] // d.topology.ep_size, *w.shape[1:]) for w in weights]

        def zeros(shape):  # [shards * local rows, ...], sharded over every mesh axis
            spec = (axes,) + (None,) * (len(shape) - 1)
            init = lambda key, shape, dtype: jnp.zeros(shape, dtype)  # noqa: E731
            shape = (shards * shape[0], *shape[1:])
            return nnx.with_partitioning(init, spec, mesh=mesh)(None, shape, block.dtype)

        block.grad_feedback = nnx.List(
            [GradFeedback(zeros(s)) for per_axis in d.feedback_shapes(local) for s in per_axis]
        )


def reset_sr_reference(block) -> None:
    """Sets a persistent SR shared expert to the mean of the block's current experts."""
    if hasattr(block, "sr_reference"):
        for ref, w in zip(block.sr_reference, block.expert_weights(), strict=True):
            ref[...] = jnp.mean(w[...], axis=0).astype(ref[...].dtype)


def prefetch_experts(blocks) -> list[Gathered | None]:
    """Every block's domain gather, for blocks called later in the same step.

    Blocks with equal domains (and dtypes) move their experts together: one collective per inner
    axis and element type for all of them. The gathers depend on the parameters alone, so they
    can run at step start, before (and beside) any layer's compute. Blocks without domains get
    None.
    """
    if isinstance(blocks, str) or not isinstance(blocks, Sequence):
        raise TypeError(f"blocks must be a sequence of MoEBlocks, got {blocks!r}")
    bad = [b for b in blocks if not hasattr(b, "domains") or not hasattr(b, "expert_weights")]
    if bad:
        raise TypeError(f"blocks must be MoEBlocks, got {bad[:4]!r}")
    out: list[Gathered | None] = [None] * len(blocks)
    groups: dict = {}
    for i, block in enumerate(blocks):
        if block.domains is not None:
            groups.setdefault((block.domains, jnp.dtype(block.dtype)), []).append(i)
    for (domains, _), members in groups.items():
        for i, g in zip(members, _gather_group([blocks[i] for i in members], domains), strict=True):
            out[i] = g
    return out


def _gather_group(blocks, domains) -> list[Gathered]:
    mig = domains.migration
    mesh = domains.mesh
    if not domains.inner_axes:  # every domain of size 1: the experts stay where they are
        return [Gathered(tuple(w[...].astype(b.dtype) for w in b.expert_weights())) for b in blocks]
    weights, refs, clocks, feedback = [], [], [], []
    for b in blocks:
        weights += [w[...].astype(b.dtype) for w in b.expert_weights()]
        if mig.persistent:
            refs += [r[...] for r in b.sr_reference]
            clocks.append(b.sr_clock[...])
        if mig.grad_compression is not None:
            feedback.append([f[...] for f in b.grad_feedback])
    n_axes = len(domains.inner_axes)
    # Per axis, every block's residuals for that axis (blocks store theirs axis-major).
    per_axis = [[f for fb in feedback for f in fb[3 * a : 3 * a + 3]] for a in range(n_axes)]
    expert_spec, every = P(domains.expert_axes), P(tuple(mesh.axis_names))
    sync_every, ep_axes = mig.sync_every, domains.expert_axes

    def body(weights, refs, clocks, per_axis):
        cast = [r.astype(w.dtype) for r, w in zip(refs, weights, strict=False)]
        gathered = domains.gather_experts(weights, cast, per_axis)
        fresh = []
        for j, clock in enumerate(clocks):
            w3, r3 = weights[3 * j : 3 * j + 3], refs[3 * j : 3 * j + 3]
            fresh += migrate.refresh(w3, r3, clock, sync_every, ep_axes)
        return tuple(gathered), tuple(fresh)

    specs = (
        (expert_spec,) * len(weights),
        (P(),) * len(refs),
        (P(),) * len(clocks),
        tuple((every,) * len(axis) for axis in per_axis),
    )
    gathered, fresh = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=specs,
        out_specs=((expert_spec,) * len(weights), (P(),) * len(refs)),
    )(tuple(weights), tuple(refs), tuple(clocks), tuple(tuple(a) for a in per_axis))
    return [
        Gathered(
            tuple(gathered[3 * j : 3 * j + 3]),
            tuple(fresh[3 * j : 3 * j + 3]) if mig.persistent else None,
        )
        for j in range(len(blocks))
    ]


def value_and_grad(fn, has_aux: bool = False):
    """`jax.value_and_grad(fn)` over `fn(params, rest, *args)` that also returns `rest` with each
    `GradFeedback` variable replaced by its next value (its cotangent, by construction of the
    compressed reduce-scatter): `(value, grads, rest)`. Without such variables `rest` comes back
    unchanged and the gradients are those of `jax.value_and_grad`."""
    if not callable(fn):
        raise TypeError(f"fn must be a callable fn(params, rest, *args), got {fn!r}")
    check_bool("has_aux", has_aux)

    def wrapped(params, rest, *args):
        feedback, other = nnx.split_state(rest, GradFeedback, ...)

        def inner(params, feedback):
            return fn(params, nnx.merge_state(feedback, other), *args)

        value, (grads, next_feedback) = jax.value_and_grad(inner, argnums=(0, 1), has_aux=has_aux)(
            params, feedback
        )
        return value, grads, nnx.merge_state(next_feedback, other)

    return wrapped
