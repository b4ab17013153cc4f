"""HuggingFace `config.json` -> MoE block settings, per family (`model_type`).

Each family's mapping reads the fields its modeling code reads and says, in settings of
`RouterConfig` and `ExpertConfig`, the MoE block of that family as HF's `model.eval()` runs it.
Every field is read by its type and range under any name the family's HF config class accepts
(`config_fields`); fields a family may set that change the block in a way the layer cannot follow
raise a ValueError naming them; training-only randomness (router jitter, token dropout in
training) is not modelled (docs/families.md says what differs in training).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from jax_hybridep.nn.hf.config_fields import REQUIRED as _REQUIRED
from jax_hybridep.nn.hf.config_fields import Config as _Config

_GATED_ACTIVATIONS = {"silu": "swiglu", "swish": "swiglu"}
_PLAIN_ACTIVATIONS = {
    "relu": "relu",
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
}


def _settings(d_model, router: dict, experts: dict) -> dict:
    return {"d_model": d_model, "router": router, "experts": experts}


def _experts_and_top_k(c: _Config, experts_key: str, top_k_key: str = "num_experts_per_tok"):
    """(E, k): the expert count and the experts per token, 1 <= k <= E."""
    num_experts = c.integer(experts_key)
    return num_experts, c.integer(top_k_key, high=num_experts)


def _softmax_family(c: _Config, *, experts_key, ff_key, normalize):
    num_experts, top_k = _experts_and_top_k(c, experts_key)
    return _settings(
        c.integer("hidden_size"),
        dict(num_experts=num_experts, top_k=top_k, normalize=normalize),
        dict(
            d_ff=c.integer(ff_key),
            activation=c.activation("hidden_act", "silu", _GATED_ACTIVATIONS),
        ),
    )


def _mixtral(c):
    return _softmax_family(
        c, experts_key="num_local_experts", ff_key="intermediate_size", normalize=True
    )


def _qwen2_moe(c):
    s = _softmax_family(
        c,
        experts_key="num_experts",
        ff_key="moe_intermediate_size",
        normalize=c.flag("norm_topk_prob", False),
    )
    shared = c.integer("shared_expert_intermediate_size", low=0)
    if shared:
        s["experts"].update(shared_ff=shared, shared_gate=True)
    return s


def _qwen3_moe(c):
    return _softmax_family(
        c,
        experts_key="num_experts",
        ff_key="moe_intermediate_size",
        normalize=c.flag("norm_topk_prob", False),
    )


def _olmoe(c):
    return _softmax_family(
        c,
        experts_key="num_experts",
        ff_key="intermediate_size",
        normalize=c.flag("norm_topk_prob", False),
    )


def _jamba(c):
    return _softmax_family(
        c, experts_key="num_experts", ff_key="intermediate_size", normalize=False
    )


def _granitemoe(c):
    # Top-k of the logits, then a softmax over the k: the normalised top-k of the softmax.
    return _softmax_family(
        c, experts_key="num_local_experts", ff_key="intermediate_size", normalize=True
    )


def _deepseek(c, router, shared_default=_REQUIRED):
    """A DeepSeek-style model's settings from its router's: experts of moe_intermediate_size, and
    its n_shared_experts shared experts as one shared expert n times as wide."""
    d_ff = c.integer("moe_intermediate_size")
    s = _settings(
        c.integer("hidden_size"),
        router,
        dict(d_ff=d_ff, activation=c.activation("hidden_act", "silu", _GATED_ACTIVATIONS)),
    )
    shared = c.integer("n_shared_experts", shared_default, low=0)
    if shared:
        s["experts"]["shared_ff"] = shared * d_ff
    return s


def _groups(c, router, score, default=_REQUIRED):
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
    num_experts, k = _experts_and_top_k(c, "n_routed_experts")
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
    num_experts, k = _experts_and_top_k(c, "n_routed_experts")
    router = dict(
        num_experts=num_experts,
        top_k=k,
        score_fn="sigmoid",
        normalize=c.flag("norm_topk_prob", True),
        routed_scale=c.number("routed_scaling_factor", low=0.0, above=True),
    )
    _groups(c, router, "top2_sum")
    return _deepseek(c, router)


def _dbrx(c):
    ffn = c.nested("ffn_config")
    p = ffn.config.get("moe_normalize_expert_weights", 1)  # null: no normalisation
    if isinstance(p, bool) or p not in (None, 1, 1.0):
        ffn.fail("moe_normalize_expert_weights", "is not 1 or None (only the L1 norm is offered)")
    num_experts, top_k = _experts_and_top_k(ffn, "moe_num_experts", "moe_top_k")
    return _settings(
        c.integer("d_model"),
        dict(num_experts=num_experts, top_k=top_k, normalize=p is not None),
        dict(
            d_ff=ffn.integer("ffn_hidden_size"),
            activation=ffn.activation("ffn_act_fn", {"name": "silu"}, _GATED_ACTIVATIONS),
        ),
    )


def text_config(c: _Config) -> _Config:
    """Llama-4's text settings: `text_config` of a `llama4` config, or (flat) the config itself."""
    return c.nested("text_config") if "text_config" in c.config else c


def _llama4(c):
    text = text_config(c)
    num_experts, top_k = _experts_and_top_k(text, "num_local_experts")
    d_ff = text.integer("intermediate_size")
    return _settings(
        text.integer("hidden_size"),
        dict(num_experts=num_experts, top_k=top_k, score_fn="sigmoid", normalize=False),
        dict(
            d_ff=d_ff,
            activation=text.activation("hidden_act", "silu", _GATED_ACTIVATIONS),
            shared_ff=d_ff,
            weight_input=True,
        ),
    )


def _gpt_oss(c):
    num_experts, top_k = _experts_and_top_k(c, "num_local_experts")
    return _settings(
        c.integer("hidden_size"),
        dict(num_experts=num_experts, top_k=top_k, logit_bias=True, normalize=True),
        dict(
            d_ff=c.integer("intermediate_size"),
            activation="clamped_swiglu",
            glu_limit=c.number("swiglu_limit", 7.0, 0.0, above=True),
            glu_alpha=c.number("swiglu_alpha", 1.702, 0.0, above=True),
            expert_bias=True,
        ),
    )


def _switch(c):
    return _settings(
        c.integer("d_model"),
        dict(
            num_experts=c.integer("num_experts"),
            top_k=1,
            normalize=False,
            logit_bias=c.flag("router_bias", False),
            group_capacity=c.integer("expert_capacity"),
            token_group="sequence",
        ),
        dict(
            d_ff=c.integer("d_ff"),
            activation=c.activation("dense_act_fn", "relu", _PLAIN_ACTIVATIONS),
        ),
    )


def _nllb_moe(c):
    ff = c.integer("encoder_ffn_dim")
    if c.integer("decoder_ffn_dim", ff) != ff:
        c.fail("decoder_ffn_dim", f"differs from encoder_ffn_dim={ff}: one block shape per call")
    if c.text("second_expert_policy", "all") != "all":
        c.fail("second_expert_policy", "is random (only 'all' is reproducible)")
    if c.flag("batch_prioritized_routing", False):
        c.fail("batch_prioritized_routing", "orders the capacity fill by importance (not offered)")
    router = dict(
        num_experts=c.integer("num_experts", low=2),  # top-2 routing
        top_k=2,
        normalize=True,
        logit_bias=c.flag("router_bias", False),
        token_group="shard",
    )
    fraction = c.number("moe_eval_capacity_token_fraction", 1.0)
    if 0 < fraction < 1:
        c.fail(
            "moe_eval_capacity_token_fraction",
            "is in (0, 1): ceil(f * tokens) per expert is not offered",
        )
    if fraction <= 0:  # eval uses the training capacity: expert_capacity or 2 * ceil(n / E)
        if c.has("expert_capacity"):
            router["group_capacity"] = c.integer("expert_capacity")
        else:
            router["group_capacity_factor"] = 1.0
        if not c.flag("normalize_router_prob_before_dropping", False):
            router["renormalize_after_drops"] = True
    # (fraction >= 1: capacity >= tokens, nothing drops and both normalisations agree.)
    dropout = c.number("moe_token_dropout", 0.0, 0.0, 1.0, below=True)
    router["routed_scale"] = 1.0 - dropout  # eval scales the experts' outputs by 1 - p
    return _settings(
        c.integer("d_model"),
        router,
        dict(
            d_ff=ff,
            activation=c.activation("activation_function", "relu", _PLAIN_ACTIVATIONS),
            expert_bias=True,
        ),
    )


FAMILIES: dict[str, Callable[[_Config], dict]] = {
    "mixtral": _mixtral,
    "qwen2_moe": _qwen2_moe,
    "qwen3_moe": _qwen3_moe,
    "deepseek_v2": _deepseek_v2,
    "deepseek_v3": _deepseek_v3,
    "glm4_moe": _deepseek_v3,
    "olmoe": _olmoe,
    "jamba": _jamba,
    "dbrx": _dbrx,
    "granitemoe": _granitemoe,
    "llama4": _llama4,
    "llama4_text": _llama4,
    "gpt_oss": _gpt_oss,
    "switch_transformers": _switch,
    "nllb_moe": _nllb_moe,
}


def model_type(config: Mapping) -> str:
    """config["model_type"], checked against the known families."""
    if not isinstance(config, Mapping):
        raise TypeError(
            f"config must be a dict (a parsed config.json), got {type(config).__name__}"
        )
    name = config.get("model_type")
    if not isinstance(name, str) or name not in FAMILIES:
        raise ValueError(
            f"unknown model_type {name!r}: jax_hybridep.nn.hf knows {sorted(FAMILIES)}"
        )
    return name


def settings(config: Mapping) -> dict:
    """{"d_model": H, "router": RouterConfig fields, "experts": ExpertConfig fields}."""
    name = model_type(config)
    return FAMILIES[name](_Config(config, name))
