"""MoE block (Flax NNX): router -> `dispatch` -> SwiGLU experts -> `combine` (+ a shared expert).

Sharding model: the block takes global activations `x [..., d_model]` under `jax.jit`; inside, a
`jax.shard_map` over every mesh axis gives each device its slice of the tokens, the expert weights
are sharded over the EP axes (expert dim) and replicated over the others (e.g. a "data" axis), and
the gate and shared expert are replicated. The block does not care how many levels the topology
has; only `dispatch`/`combine` do. With redundant slots (`jax_hybridep.balance`) the stored
experts are in the placement's order and each shard fetches its replicas before dispatch. With
expert domains (cross-DC EP) the experts are first gathered inside each domain
(`nn.migration`), by the block itself or prefetched by the model.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

import jax_hybridep as hep
from jax_hybridep import balance as balance_lib
from jax_hybridep import xdc
from jax_hybridep.nn import migration as migration_lib
from jax_hybridep.nn import moe_config
from jax_hybridep.nn.experts import ExpertConfig, expert_swiglu, swiglu
from jax_hybridep.nn.migration import Gathered
from jax_hybridep.nn.router import Router, RouterConfig, route

DISPATCH_NAME = "moe_dispatch"  # checkpoint_name of the dispatched rows (for remat policies)
COMBINE_NAME = "moe_combine"  # checkpoint_name of the combined output


@dataclasses.dataclass(frozen=True)
class MoEAux:
    """What the block reports besides its output (global over the batch).

    Attributes:
      loss: aux_loss_coef * aux_loss + z_loss_coef * z_loss, to add to the training loss.
      aux_loss, z_loss: raw router losses, averaged over shards.
      tokens_per_expert: [E] int32 rows routed to each expert, summed over EP groups, before drops.
      dropped: [] int32 rows dropped over capacity, all shards.
      level_rows: [token levels] int32 token copies sent to other ranks at each level of the
        token exchange (`MoEBlock.token_levels`), all shards, one dispatch.
      tokens_per_slot: [EP x slots per rank] int32 rows routed to each physical expert slot
        (rank-major), before drops; without a replica placement, the experts themselves.
      sr_shared: with a persistent SR shared expert, its value after this step (refreshed every
        `sync_every` steps), for `MoEBlock.update_state`; else None.
    """

    loss: jax.Array
    aux_loss: jax.Array
    z_loss: jax.Array
    tokens_per_expert: jax.Array
    dropped: jax.Array
    level_rows: jax.Array
    tokens_per_slot: jax.Array | None = None
    sr_shared: tuple[jax.Array, ...] | None = None


jax.tree_util.register_dataclass(
    MoEAux,
    data_fields=[
        "loss",
        "aux_loss",
        "z_loss",
        "tokens_per_expert",
        "dropped",
        "level_rows",
        "tokens_per_slot",
        "sr_shared",
    ],
    meta_fields=[],
)  # fmt: skip


def _param(rngs, shape, sharding, mesh, dtype):
    """A parameter initialised N(0, 1/fan_in) with its mesh sharding recorded (fan_in: dim -2)."""
    init = nnx.initializers.normal(stddev=shape[-2] ** -0.5)
    return nnx.Param(nnx.with_partitioning(init, sharding, mesh=mesh)(rngs.params(), shape, dtype))


class SharedExpert(nnx.Module):
    """An always-on SwiGLU expert applied to every token (replicated weights); not the SR shared
    expert of expert domains (`nn.migration.SRReference`)."""

    def __init__(self, d_model, d_ff, *, mesh, rngs: nnx.Rngs, param_dtype=jnp.float32):
        self.gate = _param(rngs, (d_model, d_ff), (None, None), mesh, param_dtype)
        self.up = _param(rngs, (d_model, d_ff), (None, None), mesh, param_dtype)
        self.down = _param(rngs, (d_ff, d_model), (None, None), mesh, param_dtype)

    def __call__(self, x):
        dtype = x.dtype
        return swiglu(
            x,
            self.gate[...].astype(dtype),
            self.up[...].astype(dtype),
            self.down[...].astype(dtype),
        )


class MoEBlock(nnx.Module):
    """Top-k routed SwiGLU experts (stacked [E, ...] weights sharded over the EP axes).

    Args:
      d_model: model width H.
      router: RouterConfig (num_experts and top_k live there).
      experts: ExpertConfig: the experts' hidden width, an always-on shared expert, dtypes.
      mesh: the device mesh (AxisType.Auto axes).
      topology: hep.Topology over (some of) the mesh's axes: the EP group.
      dispatch: hep.DispatchConfig; num_experts defaults to the router's. The block runs it with
        zero_padding=False (its expert compute never reads rows past the groups).
      migration: an `xdc.Migration` with domains (cross-datacenter EP, docs/design.md §4):
        experts are all-gathered inside each domain and tokens cross only between domains.
        Parameters keep the plain-EP sharding, so checkpoints move freely between settings.
        Exact (values and gradients equal plain EP's) unless it compresses: SR compression of
        the gathered experts (its reference "persistent" kept as state and refreshed every
        `sync_every` steps by `update_state`, "mean" or "none"; `xdc.compress`) or top-k
        gradient compression with error feedback held in `GradFeedback` variables (train with
        `nn.value_and_grad`). None, or no domains: plain EP.
      balance: a `balance.BalanceConfig`: redundant expert slots per EP rank for copies of hot
        experts and the placement to start from; the stored weights keep one copy of each
        expert, in the placement's order, and `set_placement` moves to another. Exact: values
        and gradients equal the block without copies' (dropless; with a capacity, it is per
        physical slot). None: plain EP's order, no placement.
      rngs: parameter initialisation.
    """

    EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")  # the stacked [E, ...] expert parameters

    def __init__(
        self,
        d_model: int,
        *,
        router: RouterConfig,
        experts: ExpertConfig,
        mesh: jax.sharding.Mesh,
        topology: hep.Topology,
        dispatch: hep.DispatchConfig | None = None,
        migration: xdc.Migration | None = None,
        balance: balance_lib.BalanceConfig | None = None,
        rngs: nnx.Rngs,
    ):
        moe_config.check_block(d_model, router, experts, mesh, topology)
        self.mesh, self.topology, self.expert_config = mesh, topology, experts
        self.dispatch_config = moe_config.block_dispatch(dispatch, router)
        self.domains = moe_config.block_domains(migration, mesh, topology)
        self.placement = moe_config.block_placement(
            balance, self.dispatch_config, topology, self.domains
        )
        self.dtype = experts.dtype
        param_dtype = experts.param_dtype
        self.router = Router(d_model, router, rngs=rngs, param_dtype=param_dtype)
        ep = topology.ep_axes  # the expert dim spans every EP axis
        e, d_ff = router.num_experts, experts.d_ff
        self.w_gate = _param(rngs, (e, d_model, d_ff), (ep, None, None), mesh, param_dtype)
        self.w_up = _param(rngs, (e, d_model, d_ff), (ep, None, None), mesh, param_dtype)
        self.w_down = _param(rngs, (e, d_ff, d_model), (ep, None, None), mesh, param_dtype)
        self.shared = (
            SharedExpert(d_model, experts.shared_ff, mesh=mesh, rngs=rngs, param_dtype=param_dtype)
            if experts.shared_ff is not None
            else None
        )
        migration_lib.init_state(self)

    def expert_weights(self):
        """The (w_gate, w_up, w_down) parameters."""
        return self.w_gate, self.w_up, self.w_down

    def reset_sr_reference(self):
        """Sets a persistent SR shared expert to the mean of the current experts (e.g. after
        the parameters were restored or the block rebuilt)."""
        migration_lib.reset_sr_reference(self)

    def gather(self) -> Gathered | None:
        """This block's domain gather on its own (`nn.migration.prefetch_experts` gathers many
        blocks' at once); None without domains."""
        return migration_lib.prefetch_experts([self])[0]

    def __call__(self, x, experts: Gathered | None = None) -> tuple[jax.Array, MoEAux]:
        """x [..., d_model] -> (y [..., d_model] in x's dtype, MoEAux).

        `experts`: this block's gather, already done (`nn.migration.prefetch_experts`); by
        default a block with domains gathers its experts itself.
        """
        lead, d_model = x.shape[:-1], x.shape[-1]
        tokens = x.reshape(-1, d_model)
        shards = self.mesh.devices.size
        if tokens.shape[0] % shards:
            raise ValueError(
                f"MoEBlock: {tokens.shape[0]} tokens (x shape {x.shape}) do not split evenly over "
                f"the {shards} devices of mesh {dict(self.mesh.shape)}"
            )
        mesh, token_topology, _ = self._exchange()
        all_axes = P(tuple(mesh.axis_names))
        expert_spec = P(self.domains.expert_axes if self.domains else self.topology.ep_axes)
        if self.domains is None:
            if experts is not None:
                raise ValueError("MoEBlock: experts were gathered for a block without domains")
            weights = tuple(w[...].astype(self.dtype) for w in self.expert_weights())
        else:
            experts = self.gather() if experts is None else experts
            weights = experts.weights
        routed = jax.shard_map(
            self._per_shard,
            mesh=mesh,
            in_specs=(all_axes, P(), P(), expert_spec, expert_spec, expert_spec),
            out_specs=(all_axes,) * 7,
        )
        y, aux_loss, z_loss, per_expert, dropped, level_rows, per_slot = routed(
            tokens.astype(self.dtype),
            self.router.gate[...],
            self.router.bias[...],
            *weights,
        )
        if self.shared is not None:
            y = y + self.shared(tokens.astype(self.dtype))
        # Every rank of an EP group reports its group's global counts, wherever the group's
        # ranks sit in device order: sum all and divide by the group size.
        ep_size = token_topology.ep_size
        cfg = self.router.config
        aux_loss, z_loss = jnp.mean(aux_loss), jnp.mean(z_loss)
        aux = MoEAux(
            loss=cfg.aux_loss_coef * aux_loss + cfg.z_loss_coef * z_loss,
            aux_loss=aux_loss,
            z_loss=z_loss,
            tokens_per_expert=jnp.sum(per_expert, axis=0, dtype=jnp.int32) // ep_size,
            dropped=jnp.sum(dropped, dtype=jnp.int32),
            level_rows=jnp.sum(level_rows, axis=0, dtype=jnp.int32),
            tokens_per_slot=jnp.sum(per_slot, axis=0, dtype=jnp.int32) // ep_size,
            sr_shared=experts.sr_shared if experts is not None else None,
        )
        return y.reshape(*lead, -1).astype(x.dtype), aux

    @property
    def token_levels(self) -> tuple[tuple[str, ...], ...]:
        """Levels (mesh axes) the tokens are exchanged over, slow -> fast."""
        return self._exchange()[1].levels

    def _exchange(self):
        """(mesh, token topology, dispatch config) of the token exchange."""
        if self.domains is None:
            return self.mesh, self.topology, self.dispatch_config
        d = self.domains
        return d.mesh, d.token_topology, d.dispatch_config(self.dispatch_config)

    def _per_shard(self, x, gate, bias, w_gate, w_up, w_down):
        _, topology, config = self._exchange()
        routing = route(
            jnp.dot(x.astype(jnp.float32), gate.astype(jnp.float32)), bias, self.router.config
        )
        if self.placement is not None:  # logical ids -> physical slots, replicas fetched
            replicas = balance_lib.Replicas(self.placement, topology)
            w_gate, w_up, w_down = replicas.gather((w_gate, w_up, w_down))
            d = replicas.dispatch(x, routing.topk_idx, routing.topk_weights, config=config)
            per_slot = d.stats.tokens_per_slot
        else:
            d = hep.dispatch(
                x, routing.topk_idx, routing.topk_weights, topology=topology, config=config
            )
            per_slot = d.stats.tokens_per_expert
        rows = checkpoint_name(d.tokens, DISPATCH_NAME)
        y = expert_swiglu(
            rows,
            d.group_sizes,
            w_gate,
            w_up,
            w_down,
            capacity=d.capacity,
            platform=topology.platform,
        )
        out = checkpoint_name(hep.combine(y, d.handle, weights=d.weights), COMBINE_NAME)
        return (
            out,
            routing.aux_loss[None],
            routing.z_loss[None],
            d.stats.tokens_per_expert[None],
            d.stats.dropped[None],
            d.stats.level_rows[None],
            per_slot[None],
        )

    @property
    def slots_per_rank(self) -> int:
        """Physical expert slots per EP rank (`MoEAux.tokens_per_slot` is rank-major)."""
        if self.placement is not None:
            return self.placement.slots
        return self.router.config.num_experts // self.topology.ep_size

    def set_placement(self, placement: balance_lib.Placement) -> None:
        """Moves the stored expert weights to `placement`'s order and runs with it from now
        on (a new placement is a new static graph: jitted steps recompile). Optimiser state
        shaped like the weights must move alike: `balance.move_experts`."""
        if self.placement is None:
            raise ValueError("set_placement needs a block built with a balance config")
        slots = self.placement.redundant_per_rank
        new = balance_lib.BalanceConfig(slots, placement).placement_for(
            self.dispatch_config.num_experts, self.topology
        )
        perm = balance_lib.permutation(self.placement, new)
        for name in self.EXPERT_WEIGHTS:
            param = getattr(self, name)
            param[...] = balance_lib.moves.permute(param[...], perm)
        self.placement = new

    def update_router_bias(self, tokens_per_expert):
        """Auxiliary-loss-free balancing step (no-op when router.bias_update_rate is 0)."""
        self.router.update_bias(tokens_per_expert)

    def update_state(self, aux: MoEAux):
        """After a training step: the router bias step and, with a persistent SR shared
        expert, its value after the step (and its clock)."""
        self.update_router_bias(aux.tokens_per_expert)
        if aux.sr_shared is not None:
            for ref, value in zip(self.sr_reference, aux.sr_shared, strict=True):
                ref[...] = value
            self.sr_clock[...] = self.sr_clock[...] + 1
