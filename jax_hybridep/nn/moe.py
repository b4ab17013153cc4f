"""MoE block (Flax NNX): router -> `dispatch` -> experts -> `combine` (+ a shared expert). The
block holds the parameters and its settings; the computation is functions (`nn/moe_compute.py`)
it calls with the token exchange resolved once per call (`moe_config.block_exchange`).

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

import jax
import jax.numpy as jnp
from flax import nnx

import jax_hybridep as hep
from jax_hybridep import balance as balance_lib
from jax_hybridep.nn import migration_state, moe_config
from jax_hybridep.nn.experts import FFN, ExpertConfig
from jax_hybridep.nn.migration_state import Gathered
from jax_hybridep.nn.moe_compute import COMBINE_NAME, DISPATCH_NAME, MoEAux, routed_experts
from jax_hybridep.nn.router import Router, RouterConfig, RouterOutput
from jax_hybridep.xdc.migration import Migration

__all__ = ["COMBINE_NAME", "DISPATCH_NAME", "MoEAux", "MoEBlock", "SharedExpert"]


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
      topology: hep.Topology over (some of) the mesh's axes: the EP group; one from
        `Topology.from_mesh` holds the mesh the block runs on (AxisType.Auto axes).
      mesh: the device mesh, only for a topology that holds none; given with a topology that
        does, it must be that mesh.
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
        topology: hep.Topology,
        mesh: jax.sharding.Mesh | None = None,
        dispatch: hep.DispatchConfig | None = None,
        migration: Migration | None = None,
        balance: balance_lib.BalanceConfig | None = None,
        rngs: nnx.Rngs,
    ):
        moe_config.check_block(d_model, router, experts)
        mesh = moe_config.block_mesh(mesh, topology, router)
        # The mesh is kept beside the topology: it tells apart blocks whose topologies are equal
        # (Topology equality leaves its mesh out) but run on other devices.
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
        exchange = self.exchange()  # resolved once per call
        group_size = self._group_size(x)
        if self.domains is None:
            if experts is not None:
                raise ValueError("MoEBlock: experts were gathered for a block without domains")
            weights = tuple(w[...].astype(self.dtype) for w in self.expert_weights())
        else:
            experts = self.gather() if experts is None else experts
            weights = experts.weights
        router_params = (self.router.gate[...], self.router.bias[...])
        if self.router.config.logit_bias:
            router_params += (self.router.logit_bias[...],)
        y, aux = routed_experts(
            tokens.astype(self.dtype),
            router_params,
            weights,
            exchange=exchange,
            router=self.router.config,
            experts=self.expert_config,
            placement=self.placement,
            group_size=group_size,
            sr_shared=experts.sr_shared if experts is not None else None,
        )
        if self.shared is not None:
            y = y + self.shared(tokens.astype(self.dtype))
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
        return self.exchange().topology.levels

    def exchange(self) -> moe_config.Exchange:
        """The token exchange a call runs: mesh, token topology, dispatch config, expert axes."""
        return moe_config.block_exchange(
            self.mesh, self.topology, self.dispatch_config, self.domains
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
