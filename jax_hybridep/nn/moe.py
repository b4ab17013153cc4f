"""MoE block (Flax NNX): router -> `dispatch` -> experts -> `combine` (+ a shared expert).

Sharding model: the block takes global activations `x [..., d_model]` under `jax.jit`; inside, a
`jax.shard_map` over every mesh axis gives each device its slice of the tokens, the expert weights
are sharded over the EP axes (expert dim) and replicated over the others (e.g. a "data" axis), and
the gate and shared expert are replicated. The block does not care how many levels the topology
has; only `dispatch`/`combine` do. With redundant slots (`jax_hybridep.balance`) the stored
experts are in the placement's order and each shard fetches its replicas before dispatch. With
expert domains (cross-DC EP) the experts are first gathered inside each domain
(`nn.migration_state`), by the block itself or prefetched by the model.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

import jax_hybridep as hep
from jax_hybridep import balance as balance_lib
from jax_hybridep import xdc
from jax_hybridep.nn import migration_state, moe_config
from jax_hybridep.nn.experts import FFN, ExpertConfig, expert_ffn
from jax_hybridep.nn.migration_state import Gathered
from jax_hybridep.nn.router import Router, RouterConfig, RouterOutput, gate_logits, route

DISPATCH_NAME = "moe_dispatch"  # checkpoint_name of the dispatched rows (for remat policies)
COMBINE_NAME = "moe_combine"  # checkpoint_name of the combined output


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
        "router_probs",
    ],
    meta_fields=[],
)


def _param(rngs, shape, sharding, mesh, dtype, *, bias=False):
    """A parameter with its mesh sharding recorded: a weight initialised N(0, 1/fan_in)
    (fan_in: dim -2), a bias 0."""
    init = nnx.initializers.zeros if bias else nnx.initializers.normal(stddev=shape[-2] ** -0.5)
    return nnx.Param(nnx.with_partitioning(init, sharding, mesh=mesh)(rngs.params(), shape, dtype))


class SharedExpert(nnx.Module):
    """An always-on expert applied to every token (replicated weights; the routed experts'
    activation, no biases), optionally scaled per token by sigmoid(x @ output_gate [H, 1])
    (Qwen2-MoE); not the SR shared expert of expert domains (`nn.migration_state.SRReference`)."""

    def __init__(
        self,
        d_model,
        d_ff,
        *,
        mesh,
        rngs: nnx.Rngs,
        param_dtype=jnp.float32,
        ffn: FFN | None = None,
        output_gate: bool = False,
    ):
        self.ffn = ffn = ffn or FFN()
        for name, shape in ffn.shapes(d_model, d_ff).items():  # gate, up, down
            setattr(self, name[2:], _param(rngs, shape, (None, None), mesh, param_dtype))
        self.output_gate = (
            _param(rngs, (d_model, 1), (None, None), mesh, param_dtype) if output_gate else None
        )

    def __call__(self, x):
        dtype = x.dtype
        y = self.ffn(x, *(getattr(self, name[2:])[...].astype(dtype) for name in self.ffn.names))
        if self.output_gate is not None:
            y = y * jax.nn.sigmoid(jnp.dot(x, self.output_gate[...].astype(dtype)))
        return y


class MoEBlock(nnx.Module):
    """Top-k routed experts (stacked [E, ...] weights sharded over the EP axes).

    Args:
      d_model: model width H.
      router: RouterConfig (num_experts and top_k live there; the routing rule, a learned logit
        bias, an opt-in Switch/GShard group capacity).
      experts: ExpertConfig: the experts' hidden width and activation, biases, an always-on
        shared expert (and its sigmoid gate), input- or output-side weighting, dtypes.
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

    # The stacked [E, ...] expert parameters of the default experts; a block's own are
    # `self.EXPERT_WEIGHTS` (its `ExpertConfig.ffn.names`: no w_gate for non-gated activations,
    # b_* with biases).
    EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")

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
        self.ffn = experts.ffn
        self.EXPERT_WEIGHTS = self.ffn.names
        if self.domains is not None and self.EXPERT_WEIGHTS != MoEBlock.EXPERT_WEIGHTS:
            raise ValueError(
                f"expert domains (migration) move (w_gate, w_up, w_down) only; experts with "
                f"activation={experts.activation!r}, expert_bias={experts.expert_bias} have "
                f"{self.EXPERT_WEIGHTS}"
            )
        ep = topology.ep_axes  # the expert dim spans every EP axis
        for name, shape in self.ffn.shapes(d_model, experts.d_ff).items():
            spec = (ep,) + (None,) * len(shape)
            shape = (router.num_experts, *shape)
            bias = name.startswith("b_")
            setattr(self, name, _param(rngs, shape, spec, mesh, param_dtype, bias=bias))
        shared = None
        if experts.shared_ff is not None:
            shared = SharedExpert(
                d_model,
                experts.shared_ff,
                mesh=mesh,
                rngs=rngs,
                param_dtype=param_dtype,
                ffn=experts.shared_ffn,
                output_gate=experts.shared_gate,
            )
        self.shared = shared  # assigned once: nnx fixes an attribute's kind (data or static)
        migration_state.init_state(self)

    def expert_weights(self):
        """The stacked expert parameters, in `EXPERT_WEIGHTS` order."""
        return tuple(getattr(self, name) for name in self.EXPERT_WEIGHTS)

    def reset_sr_reference(self):
        """Sets a persistent SR shared expert to the mean of the current experts (e.g. after
        the parameters were restored or the block rebuilt)."""
        migration_state.reset_sr_reference(self)

    def gather(self) -> Gathered | None:
        """This block's domain gather on its own (`nn.migration_state.prefetch_experts` gathers many
        blocks' at once); None without domains."""
        return migration_state.prefetch_experts([self])[0]

    def __call__(self, x, experts: Gathered | None = None) -> tuple[jax.Array, MoEAux]:
        """x [..., d_model] -> (y [..., d_model] in x's dtype, MoEAux).

        `experts`: this block's gather, already done (`nn.migration_state.prefetch_experts`); by
        default a block with domains gathers its experts itself.
        """
        _check_input(x, self.router.gate.shape[0], experts)
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
        group_size = self._group_size(x)
        if self.domains is None:
            if experts is not None:
                raise ValueError("MoEBlock: experts were gathered for a block without domains")
            weights = tuple(w[...].astype(self.dtype) for w in self.expert_weights())
        else:
            experts = self.gather() if experts is None else experts
            weights = experts.weights
        routed = jax.shard_map(
            functools.partial(self._per_shard, group_size=group_size),
            mesh=mesh,
            in_specs=(all_axes, P(), expert_spec),
            out_specs=(all_axes,) * 8,
        )
        router_params = (self.router.gate[...], self.router.bias[...])
        if self.router.config.logit_bias:
            router_params += (self.router.logit_bias[...],)
        y, aux_loss, z_loss, per_expert, dropped, level_rows, per_slot, probs = routed(
            tokens.astype(self.dtype), router_params, tuple(weights)
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
            router_probs=jnp.mean(probs, axis=0),
        )
        return y.reshape(*lead, -1).astype(x.dtype), aux

    def _group_size(self, x) -> int | None:
        """Tokens per router group (a group capacity's "sequence" or "shard"), or None."""
        cfg = self.router.config
        if not cfg.has_group_capacity:
            return None
        tokens = x.size // x.shape[-1]
        if cfg.token_group == "shard":
            return tokens // self.mesh.devices.size
        return x.shape[-2] if x.ndim >= 3 else tokens

    def route(self, x) -> RouterOutput:
        """The routing the block gives x [..., d_model] (global; ids and weights as in
        `__call__`, the losses over all tokens at once rather than per shard)."""
        tokens = x.reshape(-1, x.shape[-1])
        return self.router(tokens.astype(self.dtype), group_size=self._group_size(x))

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

    def _per_shard(self, x, router_params, weights, *, group_size):
        _, topology, config = self._exchange()
        gate, bias, *logit_bias = router_params
        logits = gate_logits(x, gate, *logit_bias)
        routing = route(logits, bias, self.router.config, group_size=group_size)
        if self.placement is not None:  # logical ids -> physical slots, replicas fetched
            replicas = balance_lib.Replicas(self.placement, topology)
            weights = replicas.gather(weights)
            d = replicas.dispatch(x, routing.topk_idx, routing.topk_weights, config=config)
            per_slot = d.stats.tokens_per_slot
        else:
            d = hep.dispatch(
                x, routing.topk_idx, routing.topk_weights, topology=topology, config=config
            )
            per_slot = d.stats.tokens_per_expert
        rows = checkpoint_name(d.tokens, DISPATCH_NAME)
        input_side = self.expert_config.weight_input
        if input_side:  # Llama-4: the weight scales the expert's input; combine unweighted
            # A select, not a multiply, past the groups: those rows are unspecified (NaN too).
            valid = jnp.arange(rows.shape[0]) < jnp.sum(d.group_sizes)
            rows = jnp.where(valid[:, None], rows * d.weights[:, None].astype(rows.dtype), 0)
        y = expert_ffn(
            rows,
            d.group_sizes,
            weights,
            ffn=self.ffn,
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
        if isinstance(placement, balance_lib.Placement) and placement.redundant_per_rank != slots:
            raise ValueError(
                f"placement has {placement.redundant_per_rank} redundant slots per rank; the "
                f"block was built with {slots} (its slot layout is fixed)"
            )
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
        if not isinstance(aux, MoEAux):
            raise TypeError(f"aux must be the MoEAux the block returned, got {aux!r}")
        self.update_router_bias(aux.tokens_per_expert)
        if aux.sr_shared is not None:
            for ref, value in zip(self.sr_reference, aux.sr_shared, strict=True):
                ref[...] = value
            self.sr_clock[...] = self.sr_clock[...] + 1


def _check_input(x, d_model: int, experts) -> None:
    """MoEBlock's call arguments at trace time: x [..., d_model] floating (integer input would
    be computed in the experts' dtype and cast back to integers), experts Gathered or None."""
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
        raise TypeError(f"MoEBlock: x must be floating point, got {jnp.result_type(x)}")
    if jnp.ndim(x) < 1 or jnp.shape(x)[-1] != d_model:
        raise ValueError(f"MoEBlock: x must be [..., d_model={d_model}], got shape {jnp.shape(x)}")
    if experts is not None and not isinstance(experts, Gathered):
        raise TypeError(f"experts must be a Gathered (prefetch_experts) or None, got {experts!r}")
