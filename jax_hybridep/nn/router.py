"""Router: gate scores, top-k (plain or DeepSeek-V3 group-limited) and balancing losses.

Works on any token set (per shard inside `shard_map` or global): everything here is per token
except the losses and loads, which are means or counts over the tokens given.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jax_hybridep.values import check_bool, check_int, check_real

SCORE_FNS = ("softmax", "sigmoid")


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """How tokens pick experts.

    Attributes:
      num_experts: E.
      top_k: K experts per token.
      score_fn: "softmax" (over experts) or "sigmoid" (per expert, DeepSeek-V3).
      num_groups: split experts into this many equal groups (e.g. one per node) for group-limited
        routing; None for plain top-k.
      topk_groups: with num_groups, the groups kept per token, ranked by the sum of each group's
        top-2 bias-adjusted scores; the top-k experts are then taken inside them.
      normalize: rescale each token's top-k weights to sum to 1.
      routed_scale: factor on the final weights (DeepSeek-V3's routed scaling factor).
      aux_loss_coef: weight of the load-balancing loss E * sum_e f_e * P_e.
      z_loss_coef: weight of the router z-loss mean(logsumexp(logits)^2).
      bias_update_rate: step of the auxiliary-loss-free bias update (0 disables it).
    """

    num_experts: int
    top_k: int
    score_fn: str = "softmax"
    num_groups: int | None = None
    topk_groups: int | None = None
    normalize: bool = True
    routed_scale: float = 1.0
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    bias_update_rate: float = 0.0

    def __post_init__(self):
        check_int("num_experts", self.num_experts, 1)
        check_int("top_k", self.top_k, 1)
        check_bool("normalize", self.normalize)
        check_real("routed_scale", self.routed_scale, positive=True)
        for name in ("aux_loss_coef", "z_loss_coef", "bias_update_rate"):
            check_real(name, getattr(self, name), 0.0)
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.score_fn not in SCORE_FNS:
            raise ValueError(f"score_fn must be one of {SCORE_FNS}, got {self.score_fn!r}")
        if (self.num_groups is None) != (self.topk_groups is None):
            raise ValueError("num_groups and topk_groups go together (both set or both None)")
        if self.num_groups is not None:
            check_int("num_groups", self.num_groups, 1)
            check_int("topk_groups", self.topk_groups, 1)
            if self.num_experts % self.num_groups:
                raise ValueError(
                    f"num_experts={self.num_experts} is not divisible by "
                    f"num_groups={self.num_groups}"
                )
            per_group = self.num_experts // self.num_groups
            if not 1 <= self.topk_groups <= self.num_groups:
                raise ValueError(f"topk_groups={self.topk_groups} not in [1, {self.num_groups}]")
            if self.topk_groups * per_group < self.top_k:
                raise ValueError(
                    f"topk_groups={self.topk_groups} groups of {per_group} experts cannot hold "
                    f"top_k={self.top_k} experts"
                )
            if per_group < 2:
                raise ValueError("group-limited routing ranks groups by their top-2 scores")


@dataclasses.dataclass(frozen=True)
class RouterOutput:
    """Per token: topk_idx [N, K] int32, topk_weights [N, K] float32, scores [N, E] float32.
    Over the tokens: aux_loss, z_loss (raw, unweighted scalars), load [E] int32 (rows per expert).
    """

    topk_idx: jax.Array
    topk_weights: jax.Array
    scores: jax.Array
    aux_loss: jax.Array
    z_loss: jax.Array
    load: jax.Array


jax.tree_util.register_dataclass(
    RouterOutput,
    data_fields=["topk_idx", "topk_weights", "scores", "aux_loss", "z_loss", "load"],
    meta_fields=[],
)


def route(logits, bias, config: RouterConfig) -> RouterOutput:
    """Routes tokens from gate logits [N, E]; `bias` [E] only steers selection (aux-loss-free)."""
    logits = logits.astype(jnp.float32)
    _check_route(logits, bias, config)
    n, num_experts = logits.shape
    if config.score_fn == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
    else:
        scores = jax.nn.sigmoid(logits)
    selection = scores + jax.lax.stop_gradient(bias).astype(jnp.float32)
    if config.num_groups is not None:
        grouped = selection.reshape(n, config.num_groups, -1)
        group_score = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [N, G]
        _, keep = jax.lax.top_k(group_score, config.topk_groups)
        group_mask = jnp.zeros_like(group_score, bool).at[jnp.arange(n)[:, None], keep].set(True)
        mask = jnp.repeat(group_mask, num_experts // config.num_groups, axis=1)
        selection = jnp.where(mask, selection, -jnp.inf)
    _, topk_idx = jax.lax.top_k(jax.lax.stop_gradient(selection), config.top_k)
    topk_weights = jnp.take_along_axis(scores, topk_idx, axis=-1)
    if config.normalize:
        topk_weights = topk_weights / (jnp.sum(topk_weights, axis=-1, keepdims=True) + 1e-20)
    topk_weights = topk_weights * config.routed_scale

    load = jnp.zeros(num_experts, jnp.int32).at[topk_idx.reshape(-1)].add(1)
    fraction = load.astype(jnp.float32) / (n * config.top_k)
    probs = scores / jnp.sum(scores, axis=-1, keepdims=True)  # sigmoid scores as a distribution
    aux_loss = num_experts * jnp.sum(fraction * jnp.mean(probs, axis=0))
    z_loss = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
    return RouterOutput(topk_idx.astype(jnp.int32), topk_weights, scores, aux_loss, z_loss, load)


class RouterBias(nnx.Variable):
    """Per-expert selection bias for auxiliary-loss-free balancing: set by a rule, not trained."""


class Router(nnx.Module):
    """Linear gate (no bias) + `route`; holds the auxiliary-loss-free selection bias."""

    def __init__(
        self, d_model: int, config: RouterConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32
    ):
        check_int("d_model", d_model, 1)
        if not isinstance(config, RouterConfig):
            raise TypeError(f"config must be a jax_hybridep.nn.RouterConfig, got {config!r}")
        self.config = config
        init = nnx.initializers.normal(stddev=d_model**-0.5)
        self.gate = nnx.Param(init(rngs.params(), (d_model, config.num_experts), param_dtype))
        self.bias = RouterBias(jnp.zeros((config.num_experts,), jnp.float32))

    def __call__(self, x) -> RouterOutput:
        """x [N, d_model] -> RouterOutput."""
        logits = jnp.dot(x.astype(jnp.float32), self.gate[...].astype(jnp.float32))
        return route(logits, self.bias[...], self.config)

    def update_bias(self, tokens_per_expert):
        """DeepSeek-V3's auxiliary-loss-free step: raise the bias of under-loaded experts."""
        if jnp.shape(tokens_per_expert) != (self.config.num_experts,):
            raise ValueError(
                f"tokens_per_expert must be [E] = [{self.config.num_experts}], got shape "
                f"{jnp.shape(tokens_per_expert)}"
            )
        if self.config.bias_update_rate == 0.0:
            return
        load = tokens_per_expert.astype(jnp.float32)
        step = self.config.bias_update_rate * jnp.sign(jnp.mean(load) - load)
        self.bias[...] = self.bias[...] + step


def _check_route(logits, bias, config) -> None:
    """route's arguments at trace time: config a RouterConfig, logits [N, E] and bias [E] with E
    the config's experts."""
    if not isinstance(config, RouterConfig):
        raise TypeError(f"config must be a jax_hybridep.nn.RouterConfig, got {config!r}")
    e = config.num_experts
    if logits.ndim != 2 or logits.shape[1] != e:
        raise ValueError(f"logits must be [N, E={e}] (one per expert), got shape {logits.shape}")
    if jnp.shape(bias) != (e,):
        raise ValueError(f"bias must be [E] = [{e}], got shape {jnp.shape(bias)}")
