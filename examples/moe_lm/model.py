"""A small decoder-only transformer LM whose FFNs are jax_hybridep's expert-parallel MoE block.

Layout (pre-norm): byte embedding -> N x [RMSNorm -> causal multi-head self-attention with rotary
positions -> residual; RMSNorm -> `jax_hybridep.nn.MoEBlock` -> residual] -> RMSNorm -> LM head.

Sharding model: the model is called on global [B, S] arrays under `jax.jit` on a mesh whose axes
are all `AxisType.Auto`. Attention and the dense layers are left to the compiler (the batch is
sharded over every mesh axis, dense parameters are replicated); each MoE block shards its tokens
over all mesh axes itself and places its experts over the EP axes (the mesh axes other than
"data"), dispatching and combining inside its own `shard_map`. `make_mesh` builds that mesh and
topology from a "data=2,ep=4"-style spec.

Cross-DC EP (`jax_hybridep.xdc`): with expert domains (for all layers, or per layer) each block
gathers its experts inside its domain; with `prefetch` the model gathers every layer's experts at
step start, before the first layer (`nn.prefetch_experts`). `describe_workload` states the model
step for the planner; `rebuild` carries a running model's state over to new domains (re-planning).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType

import jax_hybridep as hep
from examples.job_runtime.flag_fields import setting
from examples.moe_lm.data import VOCAB_SIZE
from jax_hybridep import balance, xdc
from jax_hybridep import nn as hnn
from jax_hybridep.config import BACKENDS
from jax_hybridep.fp8 import WIRE_DTYPES

DATA_AXIS = "data"  # the one mesh axis that is not part of the EP topology


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Model sizes and the MoE routing/dispatch settings.

    A field the main job's command line sets says what it is in its help, its flag's --help
    (`examples/job_runtime/flag_fields.py`); the defaults are the main job's. The others:

    Attributes:
      vocab_size: the data's vocabulary, 256 bytes.
      aux_loss_coef, z_loss_coef: weights of the router's balancing and z losses.
      balance: the blocks' expert load balancing (`balance.BalanceConfig`: redundant slots for
        copies of hot experts; a placement even without them, so the main job's re-balancing,
        `examples/train_moe/rebalance.py`, can move experts between ranks); None: none. The main
        job sets it from its --redundant_slots and --rebalance_every (`TrainConfig.built_model`).
      layer_domains: per layer, its domain sizes ((axis, S), ...) (() for plain EP); overrides
        migration.domains (the re-planner's per-layer plans).

    `check` (when a model is built) holds the rules between fields: d_model splits into heads of
    even size, layer_domains names every layer. Not at construction: the main job builds its
    config from unchecked flags and checks it whole, naming the flags (`train_moe/config.py`).
    """

    vocab_size: int = VOCAB_SIZE
    d_model: int = setting(128, "model width")
    d_ff: int = setting(256, "expert FFN hidden width")
    layers: int = setting(2, "transformer layers")
    heads: int = setting(4, "attention heads")
    experts: int = setting(8, "routed experts per layer")
    top_k: int = setting(2, "experts per token")
    capacity_factor: float | None = setting(None, "per-expert capacity factor, a number > 0")
    backend: str = setting("auto", "dispatch/combine backend", choices=BACKENDS)
    aux_loss_coef: float = 1e-2
    z_loss_coef: float = 1e-3
    migration: xdc.Migration = setting(
        xdc.Migration(), "cross-DC expert domain sizes per EP level, e.g. 'dc=2' (unset: plain EP)"
    )
    wire_dtype: str | None = setting(
        None,
        "FP8 dispatch (one scale per 128 elements); unset: the model's dtype",
        choices=WIRE_DTYPES,
    )
    balance: balance.BalanceConfig | None = None
    prefetch: bool = setting(False, "gather every layer's experts at step start")
    layer_domains: tuple[tuple[tuple[str, int], ...], ...] | None = None

    def domains_of(self, layer: int) -> tuple[tuple[str, int], ...] | None:
        """The domain sizes of MoE layer `layer` (None: plain EP)."""
        if self.layer_domains is not None:
            return self.layer_domains[layer] or None
        return self.migration.domains or None

    def migration_of(self, layer: int) -> xdc.Migration | None:
        """MoE layer `layer`'s migration: `migration` over its domains (None: plain EP)."""
        domains = self.domains_of(layer)
        return self.migration.with_domains(domains) if domains else None

    def check(self) -> None:
        """ValueError naming the fields when they do not fit together."""
        if self.layer_domains is not None and len(self.layer_domains) != self.layers:
            raise ValueError(
                f"layer_domains gives {len(self.layer_domains)} layers, the model has {self.layers}"
            )
        if self.d_model % self.heads or (self.d_model // self.heads) % 2:
            raise ValueError(
                f"d_model={self.d_model} must split into heads={self.heads} heads of even size "
                "(rotary embeddings rotate pairs of features)"
            )


def rotary(x, positions, base: float = 10000.0):
    """Rotary position embedding of x [B, S, heads, head_dim] at positions [S]."""
    half = x.shape[-1] // 2
    freqs = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions[:, None].astype(jnp.float32) * freqs[None, :]  # [S, half]
    sin, cos = jnp.sin(angles)[None, :, None, :], jnp.cos(angles)[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


class CausalSelfAttention(nnx.Module):
    """Multi-head causal self-attention with rotary positions (no biases)."""

    def __init__(self, d_model: int, heads: int, *, rngs: nnx.Rngs):
        self.heads = heads
        self.qkv = nnx.Linear(d_model, 3 * d_model, use_bias=False, rngs=rngs)
        self.out = nnx.Linear(d_model, d_model, use_bias=False, rngs=rngs)

    def __call__(self, x):
        """x [B, S, D] -> [B, S, D]."""
        b, s, d = x.shape
        q, k, v = jnp.split(self.qkv(x).reshape(b, s, 3, self.heads, d // self.heads), 3, axis=2)
        positions = jnp.arange(s)
        q, k, v = rotary(q[:, :, 0], positions), rotary(k[:, :, 0], positions), v[:, :, 0]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.float32(d // self.heads))
        causal = jnp.tril(jnp.ones((s, s), bool))
        probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
        return self.out(jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, d))


class DecoderLayer(nnx.Module):
    """Pre-norm attention and MoE sublayers, each with a residual."""

    def __init__(self, config: ModelConfig, mesh, topology, *, rngs: nnx.Rngs, index: int = 0):
        self.attn_norm = nnx.RMSNorm(config.d_model, rngs=rngs)
        self.attn = CausalSelfAttention(config.d_model, config.heads, rngs=rngs)
        self.moe_norm = nnx.RMSNorm(config.d_model, rngs=rngs)
        router = hnn.RouterConfig(
            num_experts=config.experts,
            top_k=config.top_k,
            score_fn="softmax",
            normalize=True,
            aux_loss_coef=config.aux_loss_coef,
            z_loss_coef=config.z_loss_coef,
        )
        dispatch = hep.DispatchConfig(
            num_experts=config.experts,
            capacity_factor=config.capacity_factor,
            backend=config.backend,
            wire_dtype=config.wire_dtype,
        )
        self.moe = hnn.MoEBlock(
            config.d_model,
            router=router,
            experts=hnn.ExpertConfig(d_ff=config.d_ff),
            mesh=mesh,
            topology=topology,
            dispatch=dispatch,
            migration=config.migration_of(index),
            balance=config.balance,
            rngs=rngs,
        )

    def __call__(self, x, experts=None):
        """x [B, S, D] -> (x [B, S, D], MoEAux); `experts`: the MoE block's prefetched gather."""
        x = x + self.attn(self.attn_norm(x))
        y, aux = self.moe(self.moe_norm(x), experts)
        return x + y, aux


class MoETransformer(nnx.Module):
    """Decoder-only byte LM: returns logits and the MoE blocks' auxiliary outputs."""

    def __init__(self, config: ModelConfig, mesh, topology, *, rngs: nnx.Rngs):
        config.check()
        self.config = config
        self.embed = nnx.Embed(config.vocab_size, config.d_model, rngs=rngs)
        self.layers = nnx.List(
            [DecoderLayer(config, mesh, topology, rngs=rngs, index=i) for i in range(config.layers)]
        )
        self.norm = nnx.RMSNorm(config.d_model, rngs=rngs)
        self.head = nnx.Linear(config.d_model, config.vocab_size, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        """tokens [B, S] int32 -> (logits [B, S, vocab] float32, list of MoEAux, one per layer)."""
        x = self.embed(tokens)
        blocks = [layer.moe for layer in self.layers]
        # Prefetch: every layer's experts gathered first; they wait on no layer's compute.
        gathered = hnn.prefetch_experts(blocks) if self.config.prefetch else [None] * len(blocks)
        auxes = []
        for layer, experts in zip(self.layers, gathered, strict=True):
            x, aux = layer(x, experts)
            auxes.append(aux)
        return self.head(self.norm(x)).astype(jnp.float32), auxes

    def update_state(self, auxes):
        """After a training step, every block's state: the auxiliary-loss-free bias step (a
        no-op at bias_update_rate 0) and a persistent SR shared expert's refresh."""
        for layer, aux in zip(self.layers, auxes, strict=True):
            layer.moe.update_state(aux)


def make_mesh(spec: str | None, devices) -> tuple[jax.sharding.Mesh, hep.Topology]:
    """Mesh and EP topology from "name=size,..." (e.g. "node=2,local=4", "ep=8", "data=2,ep=4").

    The mesh spans the first prod(sizes) devices, all axes `AxisType.Auto`; every axis except
    "data" is an EP level (slow -> fast in the order given). None means "ep=<all devices>" on
    accelerators and "node=2,local=<devices/2>" (a two-level topology) for fake CPU devices.
    """
    if spec is None:
        n = len(devices)
        cpu = devices[0].platform == "cpu"
        spec = f"node=2,local={n // 2}" if cpu and n >= 4 and n % 2 == 0 else f"ep={n}"
    try:
        pairs = [item.split("=") for item in spec.split(",")]
        names, sizes = [n.strip() for n, _ in pairs], [int(s) for _, s in pairs]
    except ValueError:
        raise ValueError(f"--mesh must look like 'ep=8' or 'data=2,ep=4', got {spec!r}") from None
    if any(not n for n in names) or any(s < 1 for s in sizes):
        raise ValueError(f"--mesh={spec} needs a name and a size >= 1 for every axis")
    if len(set(names)) != len(names):
        raise ValueError(f"--mesh={spec} names an axis twice")
    if math.prod(sizes) > len(devices):
        raise ValueError(f"--mesh={spec} needs {math.prod(sizes)} devices, have {len(devices)}")
    if all(n == DATA_AXIS for n in names):
        raise ValueError(f"--mesh={spec} has no EP axis (every axis but '{DATA_AXIS}' is EP)")
    grid = np.asarray(devices[: math.prod(sizes)]).reshape(sizes)
    mesh = jax.sharding.Mesh(grid, tuple(names), axis_types=(AxisType.Auto,) * len(names))
    return mesh, hep.Topology.from_mesh(mesh, levels=[n for n in names if n != DATA_AXIS])


def dense_param_bytes(params) -> int:
    """Bytes of the replicated parameters (no mesh axis named): the ones data parallelism
    all-reduces the gradients of."""
    specs = jax.tree.leaves(
        nnx.get_partition_spec(params), is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)
    )
    return sum(
        leaf.size * leaf.dtype.itemsize
        for leaf, spec in zip(jax.tree.leaves(params), specs, strict=True)
        if all(axis is None for axis in spec)
    )


def describe_workload(
    config: ModelConfig, tokens_per_rank: int, dense_bytes: int, *, act_bytes: int = 4
) -> xdc.Workload:
    """One training step of the model, per rank, for `xdc.plan` (float32 experts and
    activations by default), with the migration the config sets."""
    d, f = config.d_model, config.d_ff
    return xdc.Workload(
        tokens=tokens_per_rank,
        top_k=config.top_k,
        num_experts=config.experts,
        hidden=d,
        act_bytes=act_bytes,
        expert_matrices=((d, f), (d, f), (f, d)),
        value_bytes=act_bytes,
        migration=config.migration.with_domains(()),  # the planner chooses the domains
        prefetch=config.prefetch,
        layers=config.layers,
        dense_bytes=dense_bytes,
    )


def with_layer_domains(config: ModelConfig, level_names, layer_domains) -> ModelConfig:
    """`config` running per-layer domains given as sizes per level (a planner's answer)."""
    per_layer = tuple(
        tuple((n, int(s)) for n, s in zip(level_names, sizes, strict=True) if s > 1)
        for sizes in layer_domains
    )
    migration = config.migration.with_domains(())
    return dataclasses.replace(config, migration=migration, layer_domains=per_layer)


def rebuild(config: ModelConfig, mesh, topology, params, rest):
    """(graphdef, rest) of the model under `config` (e.g. new domains) holding `params`: the
    state it shares with `rest` (same path, type and shape: router biases, SR shared experts) is
    carried over; a new persistent SR shared expert starts as the mean of the current experts,
    new error-feedback residuals at zero (what a dropped residual had not yet sent is lost)."""
    model = MoETransformer(config, mesh, topology, rngs=nnx.Rngs(0))
    nnx.update(model, params)
    old = dict(nnx.to_flat_state(rest))
    fresh = nnx.state(model, nnx.Not(nnx.Param))
    keep = [
        (path, old[path])
        for path, var in nnx.to_flat_state(fresh)
        if path in old
        and type(old[path]) is type(var)
        and np.shape(old[path][...]) == np.shape(var[...])
    ]
    for layer in model.layers:  # then overwritten where `rest` had one
        layer.moe.reset_sr_reference()
    nnx.update(model, nnx.from_flat_state(keep))
    graphdef, _, rest = nnx.split(model, nnx.Param, ...)
    return graphdef, rest
