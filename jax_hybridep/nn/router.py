"""Router: gate scores, top-k (plain or group-limited), an optional Switch/GShard group capacity
(`nn.group_capacity`) and balancing losses.

Works on any token set (per shard inside `shard_map` or global): everything here is per token
(or per token group) except the losses and loads, which are means or counts over the tokens given.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jax_hybridep.nn import group_capacity
from jax_hybridep.pytree import pytree_record
from jax_hybridep.values import check_bool, check_int, check_real

SCORE_FNS = ("softmax", "sigmoid")
GROUP_SCORES = ("top2_sum", "max")
TOKEN_GROUPS = ("sequence", "shard")


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """How tokens pick experts.

    Attributes:
      num_experts: E.
      top_k: K experts per token.
      score_fn: "softmax" (over experts) or "sigmoid" (per expert, DeepSeek-V3).
      num_groups: split experts into this many equal groups (e.g. one per node) for group-limited
        routing; None for plain top-k.
      topk_groups: with num_groups, the groups kept per token, ranked by `group_score`; the top-k
        experts are then taken inside them.
      group_score: how a group is ranked: "top2_sum" (the sum of its top-2 bias-adjusted scores,
        DeepSeek-V3, GLM-4.5) or "max" (its best score, DeepSeek-V2).
      logit_bias: a learned per-expert bias added to the gate logits (GPT-OSS; Switch and
        NLLB-MoE with router_bias). Unlike the selection bias below it is trained and changes
        the scores, hence the weights.
      normalize: rescale each token's top-k weights to sum to 1 (top-k then softmax over the k
        is the same rule for softmax scores).
      routed_scale: factor on the final weights (DeepSeek's routed scaling factor).
      group_capacity: Switch/GShard capacity (opt-in): rows each expert may take per token group;
        later rows, in k-major order (every token's first choice before any second choice), are
        dropped before dispatch (id -1, weight 0). `nn.group_capacity`.
      group_capacity_factor: the same with the capacity `top_k * ceil(f * group_tokens / E)`
        (GShard and NLLB-MoE's training rule at f = 1). At most one of the two.
      token_group: with a group capacity, what a group is: "sequence" (the block input's
        second-to-last axis, Switch) or "shard" (each device's tokens, GShard/NLLB-MoE).
      renormalize_after_drops: with a group capacity and `normalize`, normalise the weights over
        the kept choices (NLLB-MoE's default) instead of before the drops.
      aux_loss_coef: weight of the load-balancing loss E * sum_e f_e * P_e.
      z_loss_coef: weight of the router z-loss mean(logsumexp(logits)^2).
      bias_update_rate: step of the auxiliary-loss-free bias update (0 disables it).
    """

    num_experts: int
    top_k: int
    score_fn: str = "softmax"
    num_groups: int | None = None
    topk_groups: int | None = None
    group_score: str = "top2_sum"
    logit_bias: bool = False
    normalize: bool = True
    routed_scale: float = 1.0
    group_capacity: int | None = None
    group_capacity_factor: float | None = None
    token_group: str = "sequence"
    renormalize_after_drops: bool = False
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    bias_update_rate: float = 0.0

    def __post_init__(self):
        check_int("num_experts", self.num_experts, 1)
        check_int("top_k", self.top_k, 1)
        check_bool("normalize", self.normalize)
        check_bool("logit_bias", self.logit_bias)
        check_bool("renormalize_after_drops", self.renormalize_after_drops)
        check_real("routed_scale", self.routed_scale, positive=True)
        for name in ("aux_loss_coef", "z_loss_coef", "bias_update_rate"):
            check_real(name, getattr(self, name), 0.0)
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.score_fn not in SCORE_FNS:
            raise ValueError(f"score_fn must be one of {SCORE_FNS}, got {self.score_fn!r}")
        if self.group_score not in GROUP_SCORES:
            raise ValueError(f"group_score must be one of {GROUP_SCORES}, got {self.group_score!r}")
        self._check_group_capacity()
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
            if per_group < 2 and self.group_score == "top2_sum":
                raise ValueError(
                    f"group_score='top2_sum' ranks groups by their top-2 scores, but the "
                    f"{self.num_groups} groups have {per_group} expert each (use group_score='max')"
                )

    def _check_group_capacity(self):
        if self.token_group not in TOKEN_GROUPS:
            raise ValueError(f"token_group must be one of {TOKEN_GROUPS}, got {self.token_group!r}")
        if self.group_capacity is not None and self.group_capacity_factor is not None:
            raise ValueError(
                f"group_capacity={self.group_capacity} and group_capacity_factor="
                f"{self.group_capacity_factor} are alternatives: set at most one"
            )
        if self.group_capacity is not None:
            check_int("group_capacity", self.group_capacity, 1)
        if self.group_capacity_factor is not None:
            check_real("group_capacity_factor", self.group_capacity_factor, positive=True)
        if self.renormalize_after_drops and not (self.has_group_capacity and self.normalize):
            raise ValueError(
                "renormalize_after_drops=True needs normalize=True and a group capacity "
                "(group_capacity or group_capacity_factor): it says when the weights are normalised"
            )

    @property
    def has_group_capacity(self) -> bool:
        """Whether the router caps rows per expert per token group (Switch/GShard)."""
        return self.group_capacity is not None or self.group_capacity_factor is not None


@pytree_record
@dataclasses.dataclass(frozen=True)
class RouterOutput:
    """Per token: topk_idx [N, K] int32 (-1 where a group capacity dropped the choice),
    topk_weights [N, K] float32 (0 there), scores [N, E] float32.
    Over the tokens: aux_loss, z_loss (raw, unweighted scalars), load [E] int32 (rows per expert,
    before any drop), probs [E] float32 (mean routing probability per expert, the P_e of the
    aux loss), dropped [] int32 (choices the group capacity dropped).
    """

    topk_idx: jax.Array
    topk_weights: jax.Array
    scores: jax.Array
    aux_loss: jax.Array
    z_loss: jax.Array
    load: jax.Array
    probs: jax.Array
    dropped: jax.Array


def route(logits, bias, config: RouterConfig, *, group_size: int | None = None) -> RouterOutput:
    """Routes tokens from gate logits [N, E] (a learned logit bias already added).

    `bias` [E] only steers selection (aux-loss-free). `group_size`: tokens per group for a group
    capacity (N a multiple of it; None: the N tokens are one group); unused without one.
    """
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
        if config.group_score == "max":
            group_score = jnp.max(grouped, axis=-1)  # [N, G]
        else:
            group_score = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [N, G]
        _, keep = jax.lax.top_k(group_score, config.topk_groups)
        group_mask = jnp.zeros_like(group_score, bool).at[jnp.arange(n)[:, None], keep].set(True)
        mask = jnp.repeat(group_mask, num_experts // config.num_groups, axis=1)
        selection = jnp.where(mask, selection, -jnp.inf)
    _, topk_idx = jax.lax.top_k(jax.lax.stop_gradient(selection), config.top_k)
    topk_idx = topk_idx.astype(jnp.int32)
    topk_weights = jnp.take_along_axis(scores, topk_idx, axis=-1)

    def normalized(w):
        return w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)

    if config.normalize and not config.renormalize_after_drops:
        topk_weights = normalized(topk_weights)
    load = jnp.zeros(num_experts, jnp.int32).at[topk_idx.reshape(-1)].add(1)
    dropped = jnp.zeros((), jnp.int32)
    if config.has_group_capacity:
        kept = group_capacity.keep_mask(topk_idx, config, group_size)
        dropped = jnp.sum(~kept, dtype=jnp.int32)
        topk_idx = jnp.where(kept, topk_idx, -1)
        topk_weights = jnp.where(kept, topk_weights, 0.0)
        if config.renormalize_after_drops:
            topk_weights = normalized(topk_weights)
    topk_weights = topk_weights * config.routed_scale

    fraction = load.astype(jnp.float32) / (n * config.top_k)
    probs = scores / jnp.sum(scores, axis=-1, keepdims=True)  # sigmoid scores as a distribution
    mean_probs = jnp.mean(probs, axis=0)
    aux_loss = num_experts * jnp.sum(fraction * mean_probs)
    z_loss = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
    return RouterOutput(topk_idx, topk_weights, scores, aux_loss, z_loss, load, mean_probs, dropped)


def gate_logits(x, gate, logit_bias=None):
    """x [N, H] @ gate [H, E] (+ logit_bias [E]) in float32: the router's logits [N, E]."""
    logits = jnp.dot(x.astype(jnp.float32), gate.astype(jnp.float32))
    if logit_bias is not None:
        logits = logits + logit_bias.astype(jnp.float32)
    return logits


class RouterBias(nnx.Variable):
    """Per-expert selection bias for auxiliary-loss-free balancing: set by a rule, not trained."""


class Router(nnx.Module):
    """Linear gate (+ a learned logit bias with `config.logit_bias`) + `route`; holds the
    auxiliary-loss-free selection bias."""

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
        if config.logit_bias:
            self.logit_bias = nnx.Param(jnp.zeros((config.num_experts,), param_dtype))

    def logit_bias_value(self):
        """The learned logit bias [E], or None without one."""
        return self.logit_bias[...] if self.config.logit_bias else None

    def __call__(self, x, *, group_size: int | None = None) -> RouterOutput:
        """x [N, d_model] -> RouterOutput (`group_size` as in `route`)."""
        logits = gate_logits(x, self.gate[...], self.logit_bias_value())
        return route(logits, self.bias[...], self.config, group_size=group_size)

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
