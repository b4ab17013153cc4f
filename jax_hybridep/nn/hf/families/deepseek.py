"""DeepSeek-V2 (`deepseek_v2`), DeepSeek-V3 (`deepseek_v3`) and GLM-4.5 (`glm4_moe`, built as
DeepSeek-V3): routed experts of moe_intermediate_size with n_shared_experts shared ones,
group-limited routing, DeepSeek-V3's sigmoid scores with a selection bias
(`gate.e_score_correction_bias`). One file: the three share the mapping of experts, groups and
layers and differ in the router's scores and defaults."""

from __future__ import annotations

import dataclasses

from jax_hybridep.nn.hf.config_fields import REQUIRED
from jax_hybridep.nn.hf.family import GATED_ACTIVATIONS, Family, experts_and_top_k, layers, settings
from jax_hybridep.nn.hf.tensor_layouts import PER_EXPERT, STACKED

_V3 = "gate.e_score_correction_bias"
DEEPSEEK = dataclasses.replace(
    PER_EXPERT, name="per-expert, shared_experts", shared="shared_experts", shared_gate=None
)
DEEPSEEK_STACKED = dataclasses.replace(
    STACKED, name="stacked, shared_experts", shared="shared_experts", shared_gate=None
)
DEEPSEEK_V3 = dataclasses.replace(
    DEEPSEEK, name="per-expert, shared_experts, score bias", selection_bias=_V3
)
DEEPSEEK_V3_STACKED = dataclasses.replace(
    DEEPSEEK_STACKED,
    name="stacked, shared_experts, score bias",
    selection_bias=_V3,
)


def _deepseek(c, router, shared_default=REQUIRED):
    """A DeepSeek-style model's settings from its router's: experts of moe_intermediate_size, and
    its n_shared_experts shared experts as one shared expert n times as wide."""
    d_ff = c.integer("moe_intermediate_size")
    s = settings(
        c.integer("hidden_size"),
        router,
        dict(d_ff=d_ff, activation=c.activation("hidden_act", "silu", GATED_ACTIVATIONS)),
    )
    shared = c.integer("n_shared_experts", shared_default, low=0)
    if shared:
        s["experts"]["shared_ff"] = shared * d_ff
    return s


def _groups(c, router, score, default=REQUIRED):
    """Group-limited routing: n_group groups dividing the experts, topk_group of them kept."""
    groups = c.integer("n_group", default)
    if router["num_experts"] % groups:
        c.fail("n_group", f"does not divide the {router['num_experts']} routed experts")
    if groups > 1:
        router.update(
            num_groups=groups,
            topk_groups=c.integer("topk_group", high=groups),
            group_score=score,
        )


def _deepseek_v2(c):
    if c.text("scoring_func", "softmax") != "softmax":
        c.fail("scoring_func", "is not 'softmax' (DeepSeek-V2 scores by softmax)")
    num_experts, k = experts_and_top_k(c, "n_routed_experts")
    # DeepSeek-V2's gate either normalises the top-k weights or scales them, never both.
    normalize = k > 1 and c.flag("norm_topk_prob", False)
    scale = c.number("routed_scaling_factor", 1.0, 0.0, above=True)
    router = dict(
        num_experts=num_experts,
        top_k=k,
        normalize=normalize,
        routed_scale=1.0 if normalize else scale,
    )
    method = c.text("topk_method", "greedy")
    if method == "group_limited_greedy":
        _groups(c, router, "max", default=1)
    elif method != "greedy":
        c.fail("topk_method", "is not 'greedy' or 'group_limited_greedy'")
    return _deepseek(c, router, shared_default=0)


def _deepseek_v3(c):
    if c.text("scoring_func", "sigmoid") != "sigmoid":
        c.fail("scoring_func", "is not 'sigmoid' (DeepSeek-V3 scores by sigmoid)")
    if c.text("topk_method", "noaux_tc") != "noaux_tc":
        c.fail("topk_method", "is not 'noaux_tc'")
    num_experts, k = experts_and_top_k(c, "n_routed_experts")
    router = dict(
        num_experts=num_experts,
        top_k=k,
        score_fn="sigmoid",
        normalize=c.flag("norm_topk_prob", True),
        routed_scale=c.number("routed_scaling_factor", low=0.0, above=True),
    )
    _groups(c, router, "top2_sum")
    return _deepseek(c, router)


def _layer_prefixes(first_dense_default=REQUIRED):
    """The `mlp` of layers from first_k_dense_replace on, every moe_layer_freq; HF's default
    first_k_dense_replace differs between these families (DeepSeek-V2's is 0, the others' none)."""

    def prefixes(c):
        first = c.integer("first_k_dense_replace", first_dense_default, low=0)
        freq = c.integer("moe_layer_freq", 1)
        return layers(
            c, "model.layers.{i}.mlp", lambda i: i >= first and i % freq == 0, "num_hidden_layers"
        )

    return prefixes


FAMILIES = (
    Family(
        model_type="deepseek_v2",
        settings=_deepseek_v2,
        layer_prefixes=_layer_prefixes(first_dense_default=0),
        layouts=(DEEPSEEK, DEEPSEEK_STACKED),
        aliases=(("n_routed_experts", "num_experts"),),
    ),
    Family(
        model_type="deepseek_v3",
        settings=_deepseek_v3,
        layer_prefixes=_layer_prefixes(),
        layouts=(DEEPSEEK_V3, DEEPSEEK_V3_STACKED),
        aliases=(("n_routed_experts", "num_local_experts"),),
    ),
    Family(
        model_type="glm4_moe",
        settings=_deepseek_v3,
        layer_prefixes=_layer_prefixes(),
        layouts=(DEEPSEEK_V3, DEEPSEEK_V3_STACKED),
        aliases=(("n_routed_experts", "num_local_experts"),),
    ),
)
