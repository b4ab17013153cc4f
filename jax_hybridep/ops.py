"""The public ops: `dispatch` and `combine` (docs/design.md §2), differentiable, per shard.

Sharding model: both run inside `jax.shard_map` over (at least) the topology's EP axes. Every
argument and result is per shard: `x [T, H]` are this rank's tokens, `d.tokens [C, H]` the rows
this rank's experts receive. Only `d.stats.tokens_per_expert` is global (identical on all ranks).

Gradients: dispatch's backward is a combine of the row cotangents, combine's backward a dispatch
of the output cotangent along the same handle; the routing-weight gradient returns per (t, k)
through `d.weights` or combine's `weights`. Expert ids get none.

`jax.vmap` of the forward is refused (`checks.check_context`); the backward may be mapped over
cotangents (`jax.jacrev`, `jax.vmap` of a VJP): on the `ffi` backend, whose custom calls have no
batching rule, the mapped backward runs once per cotangent in a loop (`_per_cotangent`), the same
values as the `xla` backend's vectorised one.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero, custom_vjp_primal_tree_values

from jax_hybridep import checks, compat
from jax_hybridep.config import DispatchConfig, DispatchPlan, make_plan
from jax_hybridep.exchange import routes, walk
from jax_hybridep.exchange.handle import Handle
from jax_hybridep.exchange.routes import Route
from jax_hybridep.exchange.steps import RowWeights, Shard
from jax_hybridep.pytree import pytree_record
from jax_hybridep.topology import Topology


@pytree_record
@dataclasses.dataclass(frozen=True)
class DispatchStats:
    """Counts of one dispatch.

    Attributes:
      dropped: [] int32, this shard's valid rows dropped over capacity (or, with the opt-in
        `DispatchConfig.row_budget`, over the row budget).
      invalid: [] int32, this shard's expert ids outside [-1, E).
      tokens_per_expert: [E] int32, rows routed to each expert over the EP group, before drops.
      level_rows: [levels] int32, token copies this shard sent to other ranks at each level
        (slow -> fast): the payload rows that crossed that level, each H x itemsize bytes, or
        H + 4 * ceil(H / 128) with FP8 on the wire (`jax_hybridep.traffic.level_bytes`).
    """

    dropped: jax.Array
    invalid: jax.Array
    tokens_per_expert: jax.Array
    level_rows: jax.Array


@pytree_record
@dataclasses.dataclass(frozen=True)
class Dispatched:
    """What `dispatch` returns (per shard).

    Attributes:
      tokens: [C, H] expert-major rows, in x's dtype (float8_e4m3fn with fp8_rows); rows past
        sum(group_sizes) are padding (0, or unspecified with zero_padding=False).
      weights: [C] float32 routing weight of each row (0 on padding rows).
      scales: with DispatchConfig(fp8_rows=True), [C, ceil(H / 128)] float32 block scales of
        the FP8 rows (tokens[c, h] * scales[c, h // 128] is the row); else None.
      group_sizes: [E_local] int32 rows per local expert slot, each a multiple of pad_multiple.
      kept: [T, K] bool, whether (t, k) got a row.
      stats: DispatchStats.
      handle: for `combine` (private to the route and plan of this dispatch).
    """

    tokens: jax.Array
    weights: jax.Array
    group_sizes: jax.Array
    kept: jax.Array
    stats: DispatchStats
    handle: Handle
    scales: jax.Array | None = None

    @property
    def capacity(self) -> int | None:
        """Rows kept per local expert (static), or None when dropless."""
        return self.handle.plan.capacity


def _shard(plan: DispatchPlan, manual) -> Shard:
    topology = plan.topology
    rank = jax.lax.axis_index(topology.ep_axes).astype(jnp.int32)
    group_axes = tuple(a for a in topology.group_axes if a in manual)
    group = jax.lax.axis_index(group_axes).astype(jnp.int32) if group_axes else jnp.int32(0)
    return Shard.of(plan, rank, group)


def dispatch(
    x, topk_idx, topk_weights, *, topology: Topology, config: DispatchConfig
) -> Dispatched:
    """Sends each token to the ranks of its top-k experts; returns expert-major rows.

    Args:
      x: [T, H] this shard's tokens (float32, bfloat16 or float16); with
        DispatchConfig(fp8_rows=True) also already quantised: (q [T, H] float8_e4m3fn,
        scales [T, ceil(H / 128)] float32).
      topk_idx: [T, K] integer global expert ids; -1 means "no expert", other ids outside [0, E)
        are invalid (counted in stats.invalid and ignored).
      topk_weights: [T, K] routing weights (float32); they reach each row as `weights`.
      topology: the EP topology (`Topology.from_mesh`).
      config: the `DispatchConfig`.

    Returns:
      Dispatched(tokens [C, H], weights [C], group_sizes [E_local], kept [T, K], stats, handle).
    """
    return dispatch_with_route(None, x, topk_idx, topk_weights, topology=topology, config=config)


def dispatch_with_route(
    route: Route | None, x, topk_idx, topk_weights, *, topology: Topology, config: DispatchConfig
) -> Dispatched:
    """`dispatch` along an explicit route (None: the one `config.backend` selects); tests use it
    to run step kinds the platform lacks, e.g. the CUDA bottom over a pure-JAX twin on CPU."""
    checks.check_config("dispatch", config)
    leaves = (*x, topk_idx, topk_weights) if isinstance(x, tuple) else (x, topk_idx, topk_weights)
    manual = checks.check_context("dispatch", topology, leaves)
    x, topk_idx, topk_weights = checks.check_dispatch_inputs(x, topk_idx, topk_weights, config)
    rows = x[0] if isinstance(x, tuple) else x
    plan = make_plan(topology, config, *topk_idx.shape, rows.shape[1], rows.dtype.name)
    if route is None:
        route = routes.select(config, topology, manual, plan)
    route.check(topology)
    shard = _shard(plan, manual)
    topk_idx = checks.expert_ids_int32(topk_idx, plan.num_experts)
    lay = route.layout(plan, topk_idx, shard)
    row_end = jnp.sum(lay.group_sizes, dtype=jnp.int32)
    rows_fn = _dispatch_fp8_rows if config.fp8_rows else _dispatch_rows
    tokens, scales, row_weights, handle = rows_fn(
        route, plan, x, topk_weights.astype(jnp.float32), lay.row_pos, lay.dest, row_end, shard
    )
    if config.poison_padding:
        tokens = _poison_padding(tokens, row_end)
    stats = DispatchStats(lay.dropped, lay.invalid, lay.tokens_per_expert, walk.level_rows(handle))
    kept = lay.row_pos >= 0
    return Dispatched(tokens, row_weights, lay.group_sizes, kept, stats, handle, scales)


def _poison_padding(rows, row_end):
    """rows [C, H] with NaN at rows >= row_end (the JAX_HYBRIDEP_POISON_PADDING test switch)."""
    padding = jnp.arange(rows.shape[0]) >= row_end
    return jnp.where(padding[:, None], jnp.asarray(jnp.nan, rows.dtype), rows)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _dispatch_rows(route: Route, plan: DispatchPlan, x, weights, row_pos, dest, row_end, shard):
    return walk.dispatch(route, plan, x, weights, row_pos, dest, row_end, shard)


def _dispatch_rows_fwd(route, plan, x, weights, row_pos, dest, row_end, shard):
    out = _dispatch_rows(route, plan, x, weights, row_pos, dest, row_end, shard)
    return out, out[3]  # the handle


def _per_cotangent(fn, handle, *args):
    """fn(handle, *args); mapped by `jax.vmap` (jacrev maps the backward over the cotangents) on a
    backend of custom calls, which have no batching rule, as a loop over the mapped axis: one
    call of fn per cotangent. Unmapped, or on the `xla` backend (whose ops map themselves), fn
    as it is."""
    mapped = any(compat.is_batched(leaf) for leaf in jax.tree.leaves((handle, args)))
    if not mapped or handle.route.backend == "xla":
        return fn(handle, *args)

    @jax.custom_batching.custom_vmap
    def call(handle, *args):
        return fn(handle, *args)

    @call.def_vmap
    def loop(axis_size, in_batched, handle, *args):
        leaves, tree = jax.tree.flatten((handle, args))
        flags = jax.tree.leaves(in_batched)
        stacked = [leaf for leaf, b in zip(leaves, flags, strict=True) if b]

        def one(sliced):
            it = iter(sliced)
            full = [next(it) if b else leaf for leaf, b in zip(leaves, flags, strict=True)]
            h, a = jax.tree.unflatten(tree, full)
            return fn(h, *a)

        out = jax.lax.map(one, stacked)
        return out, jax.tree.map(lambda _: True, out)

    return call(handle, *args)


def _dispatch_rows_bwd(route, plan, handle, cotangents):
    ct_tokens, _, ct_weights, _ = cotangents
    # FP8 on the wire is straight-through: the rows' cotangent is combined at 16 bits.
    unweighted = RowWeights.unweighted(handle.plan)
    grad_x = _per_cotangent(lambda h, ct: walk.combine(h, ct, unweighted), handle, ct_tokens)
    grad_weights = _per_cotangent(walk.return_row_values, handle, ct_weights)
    return grad_x, grad_weights, None, None, None, None


_dispatch_rows.defvjp(_dispatch_rows_fwd, _dispatch_rows_bwd)


# FP8 rows (DispatchConfig(fp8_rows=True)) carry no gradient: quantisation has none, and the
# straight-through one is the dequantised path's (fp8_rows=False). The routing weights still
# do, exactly: each row's weight cotangent goes back to its (t, k) as on every other path. So a
# gradient is refused only when it needs x's cotangent through the rows: x is differentiated
# (perturbed) and the rows or their scales get a cotangent that is not a symbolic zero.
@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Perturbed:
    """Whether dispatch's x was differentiated (a static residual)."""

    x: bool


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _dispatch_fp8_rows(route, plan, x, weights, row_pos, dest, row_end, shard):
    return walk.dispatch(route, plan, x, weights, row_pos, dest, row_end, shard)


def _dispatch_fp8_rows_fwd(route, plan, x, *args):
    perturbed = _Perturbed(any(leaf.perturbed for leaf in jax.tree.leaves(x)))
    x, args = custom_vjp_primal_tree_values((x, args))
    out = walk.dispatch(route, plan, x, *args)
    return out, (out[3], perturbed)


def _dispatch_fp8_rows_bwd(route, plan, residuals, cotangents):
    handle, perturbed = residuals
    ct_tokens, ct_scales, ct_weights, _ = cotangents
    zero = lambda ct: isinstance(ct, SymbolicZero)  # noqa: E731
    if perturbed.x and not (zero(ct_tokens) and zero(ct_scales)):
        raise TypeError(
            "jax_hybridep.dispatch with DispatchConfig(fp8_rows=True): this gradient needs x's "
            "cotangent through the FP8 rows, which carry none; differentiate only topk_weights "
            "(stop_gradient on x), or use the dequantised rows (fp8_rows=False: the gradient "
            "is the 16-bit path's)"
        )
    grad_weights = (
        None if zero(ct_weights) else _per_cotangent(walk.return_row_values, handle, ct_weights)
    )
    return None, grad_weights, None, None, None, None


_dispatch_fp8_rows.defvjp(_dispatch_fp8_rows_fwd, _dispatch_fp8_rows_bwd, symbolic_zeros=True)


def combine(
    y,
    handle: Handle,
    weights=None,
    *,
    topology: Topology | None = None,
    config: DispatchConfig | None = None,
):
    """Returns each token's sum of its rows (times `weights` when given), in §2.1 order.

    Args:
      y: [C, H'] expert outputs, one per row of the dispatch that made `handle`.
      handle: `Dispatched.handle` of that dispatch.
      weights: optional [C] float32 per-row weights (e.g. `Dispatched.weights`).
      topology, config: optional; when given they must be the dispatch's (checked statically).

    Returns:
      [T, H'] in y's dtype.
    """
    if not isinstance(handle, Handle):
        raise TypeError(f"handle must be Dispatched.handle, got {type(handle).__name__}")
    plan = handle.plan
    if topology is not None and not isinstance(topology, Topology):
        raise TypeError(
            f"combine: topology must be a Topology or None, got {type(topology).__name__}"
        )
    if config is not None:
        checks.check_config("combine", config)
    if topology is not None and topology != plan.topology:
        raise ValueError(
            f"combine got a handle made for topology {plan.topology.levels} "
            f"(mesh {plan.topology.mesh_dict}) but was given topology {topology.levels} "
            f"(mesh {topology.mesh_dict})"
        )
    if config is not None:
        requested = routes.select(config, plan.topology, compat.manual_axes(), plan).backend
        if config != plan.config or requested != handle.route.backend:
            raise ValueError(
                f"combine got a handle from the '{handle.route.backend}' backend with "
                f"{plan.config}, but was given {config} (backend '{requested}')"
            )
    y, weights = checks.check_combine_inputs(plan, y, weights)
    if weights is None:
        return _combine_rows(False, handle, y, RowWeights.unweighted(plan).values)
    return _combine_rows(True, handle, y, weights.astype(jnp.float32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _combine_rows(weighted: bool, handle: Handle, y, weights):
    return walk.combine(handle, y, RowWeights(weights, weighted))


def _combine_rows_fwd(weighted, handle, y, weights):
    return _combine_rows(weighted, handle, y, weights), (handle, y, weights)


def _combine_rows_bwd(weighted, residuals, g):
    handle, y, weights = residuals
    if not weighted:
        grad_y = _per_cotangent(walk.redispatch, handle, g)
        grad_weights = jnp.zeros_like(weights)
    else:
        grad_y, grad_weights = _per_cotangent(walk.combine_vjp, handle, g, y, weights)
    if handle.plan.config.poison_padding:
        grad_y = _poison_padding(grad_y, handle.row_end)
    return None, grad_y, grad_weights


_combine_rows.defvjp(_combine_rows_fwd, _combine_rows_bwd)
