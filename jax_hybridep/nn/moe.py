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
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

import jax_hybridep as hep
from jax_hybridep import balance, xdc
from jax_hybridep.nn import migration
from jax_hybridep.nn.experts import expert_swiglu, swiglu
from jax_hybridep.nn.migration import Gathered, GradFeedback, SRReference
from jax_hybridep.nn.router import Router, RouterConfig, route
from jax_hybridep.values import check_int

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


def _check_block(d_model, d_ff, router, mesh, topology, shared_expert_ff) -> None:
    """The block's arguments, checked before any parameter is made (ValueError/TypeError)."""
    check_int("d_model", d_model, 1)
    check_int("d_ff", d_ff, 1)
    if shared_expert_ff is not None:
        check_int("shared_expert_ff", shared_expert_ff, 1)
    if not isinstance(router, RouterConfig):
        raise TypeError(f"router must be a jax_hybridep.nn.RouterConfig, got {router!r}")
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if not isinstance(topology, hep.Topology):
        raise TypeError(f"topology must be a jax_hybridep.Topology, got {type(topology).__name__}")
    mesh_shape = dict(mesh.shape)
    if topology.mesh_dict != mesh_shape:
        raise ValueError(
            f"topology was built for mesh {topology.mesh_dict}, but the block's mesh is "
            f"{mesh_shape}; build it with Topology.from_mesh(mesh, ...)"
        )
    if router.num_experts % topology.ep_size:
        raise ValueError(
            f"router.num_experts={router.num_experts} experts do not split evenly over the EP "
            f"size {topology.ep_size} (EP axes {topology.ep_axes} of mesh {mesh_shape}): the "
            "stacked expert weights are sharded over them"
        )


class MoEBlock(nnx.Module):
    """Top-k routed SwiGLU experts (stacked [E, ...] weights sharded over the EP axes).

    Args:
      d_model: model width H.
      d_ff: expert hidden width F.
      router: RouterConfig (num_experts and top_k live there).
      mesh: the device mesh (AxisType.Auto axes).
      topology: hep.Topology over (some of) the mesh's axes: the EP group.
      expert_domains: optional per-level domain sizes ({level axis: S}) or an
        `xdc.ExpertDomains`: experts are all-gathered inside each domain and tokens cross only
        between domains (cross-datacenter EP, docs/design.md §4). Parameters keep the plain-EP
        sharding, so checkpoints move freely between settings. Exact (values and gradients equal
        plain EP's) unless something below compresses.
      domain_compression: SR compression ratio of the migrated experts (None: full experts).
        Not exact: the replicas are decoded from the top-k of their residuals.
      domain_shared: the SR reference: "persistent" (default: a shared expert kept as state,
        initialised as the mean of the experts, refreshed every `domain_sync_every` steps by
        `update_state`), "mean" (the domain's mean, recomputed every call) or "none" (top-k of
        the weights themselves). See `xdc.compress`.
      domain_sync_every: steps between refreshes of the persistent shared expert.
      grad_compression: top-k ratio of the replicas' gradient reduce-scatter, with error
        feedback held in `GradFeedback` variables (train with `nn.value_and_grad`). Opt-in and
        not exact.
      dispatch: hep.DispatchConfig; num_experts defaults to the router's. The block runs it with
        zero_padding=False (its expert compute never reads rows past the groups).
      shared_expert_ff: hidden width of an always-on shared SwiGLU expert, or None.
      redundant_slots: extra expert slots per EP rank for copies of hot experts
        (`jax_hybridep.balance`); the stored weights keep one copy of each expert, in the
        placement's order. Exact: values and gradients equal the block without copies'
        (dropless; with a capacity, it is per physical slot).
      placement: a `balance.Placement` to start from (default: plain EP's order, redundant
        slots empty); `set_placement` moves to another.
      dtype: compute dtype of the experts (the rows travel in it).
      param_dtype: parameter dtype.
    """

    EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")  # the stacked [E, ...] expert parameters

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        router: RouterConfig,
        mesh: jax.sharding.Mesh,
        topology: hep.Topology,
        dispatch: hep.DispatchConfig | None = None,
        expert_domains: Mapping[str, int] | xdc.ExpertDomains | None = None,
        domain_compression: float | None = None,
        domain_shared: str = "persistent",
        domain_sync_every: int = 1,
        grad_compression: float | None = None,
        shared_expert_ff: int | None = None,
        redundant_slots: int = 0,
        placement: balance.Placement | None = None,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        _check_block(d_model, d_ff, router, mesh, topology, shared_expert_ff)
        dispatch = dispatch or hep.DispatchConfig(num_experts=router.num_experts)
        if not isinstance(dispatch, hep.DispatchConfig):
            raise TypeError(f"dispatch must be a jax_hybridep.DispatchConfig, got {dispatch!r}")
        if dispatch.num_experts != router.num_experts:
            raise ValueError(
                f"dispatch.num_experts={dispatch.num_experts} differs from "
                f"router.num_experts={router.num_experts}"
            )
        if dispatch.fp8_rows:
            raise ValueError(
                "MoEBlock trains through dispatch's rows, so it needs dequantised rows: use "
                "DispatchConfig(wire_dtype='float8_e4m3fn') without fp8_rows=True"
            )
        # Both expert paths (ragged_dot, the CPU capacity windows) ignore rows past the groups by a
        # select, so the block never pays for writing them (DispatchConfig.zero_padding).
        dispatch = dataclasses.replace(dispatch, zero_padding=False)
        self.mesh, self.topology, self.dispatch_config = mesh, topology, dispatch
        if isinstance(expert_domains, xdc.ExpertDomains):
            if domain_compression is not None or grad_compression is not None:
                raise ValueError(
                    "domain_compression / grad_compression are given beside an ExpertDomains: "
                    "set them when building it (xdc.ExpertDomains.from_mesh(..., compression=..., "
                    "grad_compression=...))"
                )
            if expert_domains.topology != topology:
                raise ValueError(
                    f"expert_domains were built for topology {expert_domains.topology.levels}, "
                    f"not this block's {topology.levels}"
                )
        elif expert_domains is not None:
            expert_domains = xdc.ExpertDomains.from_mesh(
                mesh,
                topology,
                expert_domains,
                domain_compression,
                shared=domain_shared,
                sync_every=domain_sync_every,
                grad_compression=grad_compression,
            )
        elif domain_compression is not None or grad_compression is not None:
            raise ValueError(
                f"domain_compression={domain_compression}, grad_compression={grad_compression} "
                "need expert_domains (they compress the experts moved inside a domain)"
            )
        self.domains = expert_domains
        self.placement = _check_placement(self, redundant_slots, placement)
        self.dtype = dtype
        self.router = Router(d_model, router, rngs=rngs, param_dtype=param_dtype)
        ep = topology.ep_axes  # the expert dim spans every EP axis
        e = router.num_experts

        self.w_gate = _param(rngs, (e, d_model, d_ff), (ep, None, None), mesh, param_dtype)
        self.w_up = _param(rngs, (e, d_model, d_ff), (ep, None, None), mesh, param_dtype)
        self.w_down = _param(rngs, (e, d_ff, d_model), (ep, None, None), mesh, param_dtype)
        self.shared = (
            SharedExpert(d_model, shared_expert_ff, mesh=mesh, rngs=rngs, param_dtype=param_dtype)
            if shared_expert_ff is not None
            else None
        )
        self._init_migration_state()

    def expert_weights(self):
        """The (w_gate, w_up, w_down) parameters."""
        return self.w_gate, self.w_up, self.w_down

    def _init_migration_state(self):
        """The state the domains' migration keeps (`nn.migration`): a persistent SR shared
        expert, the mean of the experts; error-feedback residuals, zero."""
        d = self.domains
        if d is None or not d.inner_axes:  # every domain of size 1: plain EP, nothing migrates
            return
        if d.migration.persistent:
            self.sr_reference = nnx.List(
                [SRReference(jnp.mean(w[...], axis=0)) for w in self.expert_weights()]
            )
            self.sr_clock = SRReference(jnp.zeros((), jnp.int32))
        if d.migration.grad_compression is not None:
            shards = self.mesh.devices.size
            axes = tuple(self.mesh.axis_names)  # each device its own residuals
            zeros = lambda key, shape, dtype: jnp.zeros(shape, dtype)  # noqa: E731
            local = [
                (w.shape[0] // self.topology.ep_size, *w.shape[1:]) for w in self.expert_weights()
            ]
            self.grad_feedback = nnx.List(
                [
                    GradFeedback(
                        nnx.with_partitioning(
                            zeros, (axes,) + (None,) * (len(s) - 1), mesh=self.mesh
                        )(None, (shards * s[0], *s[1:]), self.dtype)
                    )
                    for per_axis in d.feedback_shapes(local)
                    for s in per_axis
                ]
            )

    def reset_sr_reference(self):
        """Sets a persistent SR shared expert to the mean of the current experts (e.g. after
        the parameters were restored or the block rebuilt)."""
        if hasattr(self, "sr_reference"):
            for ref, w in zip(self.sr_reference, self.expert_weights(), strict=True):
                ref[...] = jnp.mean(w[...], axis=0).astype(ref[...].dtype)

    def gather(self) -> Gathered | None:
        """This block's domain gather on its own (`nn.migration.prefetch_experts` gathers many
        blocks' at once); None without domains."""
        return migration.prefetch_experts([self])[0]

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
            replicas = balance.Replicas(self.placement, topology)
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

    def set_placement(self, placement: balance.Placement) -> None:
        """Moves the stored expert weights to `placement`'s order and runs with it from now
        on (a new placement is a new static graph: jitted steps recompile). Optimiser state
        shaped like the weights must move alike: `balance.move_experts`."""
        if self.placement is None:
            raise ValueError("set_placement needs a block built with redundant_slots or placement")
        new = _check_placement(self, self.placement.redundant_per_rank, placement)
        perm = balance.permutation(self.placement, new)
        for name in self.EXPERT_WEIGHTS:
            param = getattr(self, name)
            param[...] = balance.moves.permute(param[...], perm)
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


def _check_placement(block, redundant_slots, placement):
    """The block's replica placement (None: plain EP), checked against its experts and mesh."""
    check_int("redundant_slots", redundant_slots, 0)
    if placement is None and redundant_slots == 0:
        return None
    if block.domains is not None:
        raise ValueError(
            "redundant_slots / placement cannot be combined with expert_domains: inside a "
            "domain every expert is already replicated on every member (docs/balance.md)"
        )
    cfg, topology = block.dispatch_config, block.topology
    if cfg.expert_placement is not None or cfg.num_local_slots is not None:
        raise ValueError(
            "redundant_slots / placement replace DispatchConfig.expert_placement and "
            "num_local_slots; leave those unset"
        )
    e, ranks = cfg.num_experts, topology.ep_size
    if placement is None:
        return balance.Placement.for_topology(e, topology, redundant_slots)
    if not isinstance(placement, balance.Placement):
        raise TypeError(f"placement must be a jax_hybridep.balance.Placement, got {placement!r}")
    if (placement.num_experts, placement.num_ranks) != (e, ranks):
        raise ValueError(
            f"placement is for {placement.num_experts} experts on {placement.num_ranks} ranks; "
            f"the block has {e} experts on EP size {ranks}"
        )
    if redundant_slots and placement.redundant_per_rank != redundant_slots:
        raise ValueError(
            f"placement has {placement.redundant_per_rank} redundant slots per rank, "
            f"redundant_slots={redundant_slots}"
        )
    return placement
