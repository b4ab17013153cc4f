"""The MoE block's computation as functions of arrays and static settings; the block
(`nn/moe.py`) holds the parameters and calls them.

Sharding model: `routed_experts` takes global tokens `[N, d_model]` and runs `shard_experts`
inside one `jax.shard_map` over every axis of the exchange's mesh: each device routes its slice
of the tokens, dispatches them, runs its experts' rows (the stacked weights sharded over the
exchange's `expert_axes`) and combines. The router's parameters are replicated. What the call
reports (`MoEAux`) is summed over the shards.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

import jax_hybridep as hep
from jax_hybridep.balance.placement import Placement
from jax_hybridep.balance.runtime import Replicas
from jax_hybridep.nn.experts import ExpertConfig, expert_ffn
from jax_hybridep.nn.moe_config import Exchange
from jax_hybridep.nn.router import RouterConfig, gate_logits, route
from jax_hybridep.pytree import pytree_record

DISPATCH_NAME = "moe_dispatch"  # checkpoint_name of the dispatched rows (for remat policies)
COMBINE_NAME = "moe_combine"  # checkpoint_name of the combined output


@pytree_record
@dataclasses.dataclass(frozen=True)
class MoEAux:
    """What the block reports besides its output (global over the batch).

    Attributes:
      loss: aux_loss_coef * aux_loss + z_loss_coef * z_loss, to add to the training loss.
      aux_loss, z_loss: raw router losses, averaged over shards.
      tokens_per_expert: [E] int32 rows routed to each expert, summed over EP groups, before the
        dispatch capacity's drops (after a router group capacity's: docs/families.md).
      dropped: [] int32 rows dropped over capacity, all shards (a router group capacity's drops
        included).
      level_rows: [token levels] int32 token copies sent to other ranks at each level of the
        token exchange (`MoEBlock.token_levels`), all shards, one dispatch.
      tokens_per_slot: [EP x slots per rank] int32 rows routed to each physical expert slot
        (rank-major), before drops; without a replica placement, the experts themselves.
      sr_shared: with a persistent SR shared expert, its value after this step (refreshed every
        `sync_every` steps), for `MoEBlock.update_state`; else None.
      router_probs: [E] float32 mean routing probability of each expert over every token (the
        P_e of the load-balancing loss; `nn.hf.load_balancing_loss` pools it over layers).
    """

    loss: jax.Array
    aux_loss: jax.Array
    z_loss: jax.Array
    tokens_per_expert: jax.Array
    dropped: jax.Array
    level_rows: jax.Array
    tokens_per_slot: jax.Array | None = None
    sr_shared: tuple[jax.Array, ...] | None = None
    router_probs: jax.Array | None = None


def routed_experts(
    tokens,
    router_params,
    weights,
    *,
    exchange: Exchange,
    router: RouterConfig,
    experts: ExpertConfig,
    placement: Placement | None,
    group_size: int | None,
    sr_shared=None,
) -> tuple[jax.Array, MoEAux]:
    """tokens [N, d_model] (global, in the experts' dtype) -> (y [N, d_model], MoEAux).

    Args:
      router_params: (gate [d_model, E], bias [E], and the logit bias [E] when the router has
        one), replicated.
      weights: the stacked expert matrices, global [E or S * E, ...], sharded over
        `exchange.expert_axes` (with domains: already gathered).
      exchange: the token exchange (`moe_config.block_exchange`).
      placement: the replica placement (logical ids -> physical slots), or None.
      group_size: tokens per router group (a group capacity), or None.
      sr_shared: what `MoEAux.sr_shared` reports (the gather's refreshed SR shared expert).
    """
    every = P(tuple(exchange.mesh.axis_names))
    per_shard = functools.partial(
        shard_experts,
        exchange=exchange,
        router=router,
        experts=experts,
        placement=placement,
        group_size=group_size,
    )
    routed = jax.shard_map(
        per_shard,
        mesh=exchange.mesh,
        in_specs=(every, P(), P(exchange.expert_axes)),
        out_specs=(every,) * 8,
    )
    y, aux_loss, z_loss, per_expert, dropped, level_rows, per_slot, probs = routed(
        tokens, router_params, tuple(weights)
    )
    # Every rank of an EP group reports its group's global counts, wherever the group's ranks
    # sit in device order: sum all and divide by the group size.
    ep_size = exchange.topology.ep_size
    aux_loss, z_loss = jnp.mean(aux_loss), jnp.mean(z_loss)
    aux = MoEAux(
        loss=router.aux_loss_coef * aux_loss + router.z_loss_coef * z_loss,
        aux_loss=aux_loss,
        z_loss=z_loss,
        tokens_per_expert=jnp.sum(per_expert, axis=0, dtype=jnp.int32) // ep_size,
        dropped=jnp.sum(dropped, dtype=jnp.int32),
        level_rows=jnp.sum(level_rows, axis=0, dtype=jnp.int32),
        tokens_per_slot=jnp.sum(per_slot, axis=0, dtype=jnp.int32) // ep_size,
        sr_shared=sr_shared,
        router_probs=jnp.mean(probs, axis=0),
    )
    return y, aux


def shard_experts(x, router_params, weights, *, exchange, router, experts, placement, group_size):
    """Per shard: route x [T, d_model], dispatch, the experts' rows, combine. Returns the output
    [T, d_model] and this shard's counts, each with a leading shard axis of 1."""
    topology, config = exchange.topology, exchange.config
    gate, bias, *logit_bias = router_params
    logits = gate_logits(x, gate, *logit_bias)
    routing = route(logits, bias, router, group_size=group_size)
    if placement is not None:  # logical ids -> physical slots, replicas fetched
        replicas = Replicas(placement, topology)
        weights = replicas.gather(weights)
        d = replicas.dispatch(x, routing.topk_idx, routing.topk_weights, config=config)
        per_slot = d.stats.tokens_per_slot
    else:
        d = hep.dispatch(
            x, routing.topk_idx, routing.topk_weights, topology=topology, config=config
        )
        per_slot = d.stats.tokens_per_expert
    rows = checkpoint_name(d.tokens, DISPATCH_NAME)
    input_side = experts.weight_input
    if input_side:  # Llama-4: the weight scales the expert's input; combine unweighted
        # A select, not a multiply, past the groups: those rows are unspecified (NaN too).
        valid = jnp.arange(rows.shape[0]) < jnp.sum(d.group_sizes)
        rows = jnp.where(valid[:, None], rows * d.weights[:, None].astype(rows.dtype), 0)
    y = expert_ffn(
        rows,
        d.group_sizes,
        weights,
        ffn=experts.ffn,
        capacity=d.capacity,
        platform=topology.platform,
    )
    out = hep.combine(y, d.handle, weights=None if input_side else d.weights)
    out = checkpoint_name(out, COMBINE_NAME)
    return (
        out,
        routing.aux_loss[None],
        routing.z_loss[None],
        d.stats.tokens_per_expert[None],
        (d.stats.dropped + routing.dropped)[None],
        d.stats.level_rows[None],
        per_slot[None],
        routing.probs[None],
    )
