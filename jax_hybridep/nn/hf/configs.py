"""HuggingFace `config.json` -> MoE block settings, per family (`model_type`).

Each family's mapping reads the fields its modeling code reads and says, in settings of
`RouterConfig` and `ExpertConfig`, the MoE block of that family as HF's `model.eval()` runs it.
Fields a family may set that change the block in a way the layer cannot follow raise a ValueError
naming them; training-only randomness (router jitter, token dropout in training) is not modelled
(docs/families.md says what differs in training).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

_REQUIRED = object()
# A field whose default differs between HF's families (or versions) has none here: a config
# without it is refused, naming it, rather than read as another model.


class _Config:
    """Reads one family's config dict; every error names the model_type and the field."""

    def __init__(self, config: Mapping, model_type: str, path: str = ""):
        # path: where a nested config sits ("ffn_config."), so errors name the whole field.
        self.config, self.model_type, self.path = config, model_type, path

    def nested(self, key: str) -> _Config:
        return _Config(self.get(key), self.model_type, f"{self.path}{key}.")

    def get(self, key: str, default=_REQUIRED):
        if key in self.config and self.config[key] is not None:
            return self.config[key]
        if default is _REQUIRED:
            self.lacks(key)
        return default

    def lacks(self, key: str):
        raise ValueError(f"config.json of model_type {self.model_type!r} lacks {self.path + key!r}")

    def fail(self, key: str, why: str):
        raise ValueError(
            f"config.json of model_type {self.model_type!r}: {self.path}{key}="
            f"{self.config.get(key)!r} {why}"
        )

    def activation(self, key: str = "hidden_act", default="silu", gated: bool = True) -> str:
        act = self.get(key, default)
        if isinstance(act, Mapping):  # DBRX: {"name": "silu"}
            act = act.get("name")
        table = {"silu": "swiglu", "swish": "swiglu"} if gated else _PLAIN_ACTIVATIONS
        if act not in table:
            self.fail(key, f"is not supported here (supported: {sorted(table)})")
        return table[act]


_PLAIN_ACTIVATIONS = {
    "relu": "relu",
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
}


def _settings(d_model, router: dict, experts: dict) -> dict:
    return {"d_model": int(d_model), "router": router, "experts": experts}


def _softmax_family(c: _Config, *, experts_key, ff_key, normalize):
    return _settings(
        c.get("hidden_size"),
        dict(
            num_experts=c.get(experts_key), top_k=c.get("num_experts_per_tok"), normalize=normalize
        ),
        dict(d_ff=c.get(ff_key), activation=c.activation()),
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
        normalize=bool(c.get("norm_topk_prob", False)),
    )
    shared = c.get("shared_expert_intermediate_size")
    if shared:
        s["experts"].update(shared_ff=shared, shared_gate=True)
    return s


def _qwen3_moe(c):
    return _softmax_family(
        c,
        experts_key="num_experts",
        ff_key="moe_intermediate_size",
        normalize=bool(c.get("norm_topk_prob", False)),
    )


def _olmoe(c):
    return _softmax_family(
        c,
        experts_key="num_experts",
        ff_key="intermediate_size",
        normalize=bool(c.get("norm_topk_prob", False)),
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
    s = _settings(
        c.get("hidden_size"),
        router,
        dict(d_ff=c.get("moe_intermediate_size"), activation=c.activation()),
    )
    shared = c.get("n_shared_experts", shared_default)
    if shared:
        s["experts"]["shared_ff"] = shared * c.get("moe_intermediate_size")
    return s


def _groups(c, router, score, default=_REQUIRED):
    groups = c.get("n_group", default)
    if groups > 1:
        router.update(num_groups=groups, topk_groups=c.get("topk_group"), group_score=score)


def _deepseek_v2(c):
    if c.get("scoring_func", "softmax") != "softmax":
        c.fail("scoring_func", "is not 'softmax' (DeepSeek-V2 scores by softmax)")
    k = c.get("num_experts_per_tok")
    # DeepSeek-V2's gate either normalises the top-k weights or scales them, never both.
    normalize = k > 1 and bool(c.get("norm_topk_prob", False))
    router = dict(
        num_experts=c.get("n_routed_experts"),
        top_k=k,
        normalize=normalize,
        routed_scale=1.0 if normalize else float(c.get("routed_scaling_factor", 1.0)),
    )
    method = c.get("topk_method", "greedy")
    if method == "group_limited_greedy":
        _groups(c, router, "max", default=1)
    elif method != "greedy":
        c.fail("topk_method", "is not 'greedy' or 'group_limited_greedy'")
    return _deepseek(c, router, shared_default=0)


def _deepseek_v3(c):
    if c.get("scoring_func", "sigmoid") != "sigmoid":
        c.fail("scoring_func", "is not 'sigmoid' (DeepSeek-V3 scores by sigmoid)")
    if c.get("topk_method", "noaux_tc") != "noaux_tc":
        c.fail("topk_method", "is not 'noaux_tc'")
    router = dict(
        num_experts=c.get("n_routed_experts"),
        top_k=c.get("num_experts_per_tok"),
        score_fn="sigmoid",
        normalize=bool(c.get("norm_topk_prob", True)),
        routed_scale=float(c.get("routed_scaling_factor")),
    )
    _groups(c, router, "top2_sum")
    return _deepseek(c, router)


def _dbrx(c):
    ffn = c.nested("ffn_config")
    p = ffn.config.get("moe_normalize_expert_weights", 1)  # null: no normalisation
    if p not in (None, 1, 1.0):
        ffn.fail("moe_normalize_expert_weights", "is not 1 or None (only the L1 norm is offered)")
    return _settings(
        c.get("d_model"),
        dict(
            num_experts=ffn.get("moe_num_experts"),
            top_k=ffn.get("moe_top_k"),
            normalize=p is not None,
        ),
        dict(
            d_ff=ffn.get("ffn_hidden_size"),
            activation=ffn.activation("ffn_act_fn", default={"name": "silu"}),
        ),
    )


def _llama4(c):
    text = c.nested("text_config") if "text_config" in c.config else c
    return _settings(
        text.get("hidden_size"),
        dict(
            num_experts=text.get("num_local_experts"),
            top_k=text.get("num_experts_per_tok"),
            score_fn="sigmoid",
            normalize=False,
        ),
        dict(
            d_ff=text.get("intermediate_size"),
            activation=text.activation(),
            shared_ff=text.get("intermediate_size"),
            weight_input=True,
        ),
    )


def _gpt_oss(c):
    top_k = c.get("num_experts_per_tok", None) or c.get("experts_per_token", None)
    if top_k is None:
        c.lacks("num_experts_per_tok or experts_per_token")
    return _settings(
        c.get("hidden_size"),
        dict(
            num_experts=c.get("num_local_experts"),
            top_k=top_k,
            logit_bias=True,
            normalize=True,
        ),
        dict(
            d_ff=c.get("intermediate_size"),
            activation="clamped_swiglu",
            glu_limit=float(c.get("swiglu_limit", 7.0)),
            glu_alpha=1.702,
            expert_bias=True,
        ),
    )


def _switch(c):
    return _settings(
        c.get("d_model"),
        dict(
            num_experts=c.get("num_experts"),
            top_k=1,
            normalize=False,
            logit_bias=bool(c.get("router_bias", False)),
            group_capacity=c.get("expert_capacity"),
            token_group="sequence",
        ),
        dict(d_ff=c.get("d_ff"), activation=c.activation("dense_act_fn", "relu", gated=False)),
    )


def _nllb_moe(c):
    ff = c.get("encoder_ffn_dim")
    if c.get("decoder_ffn_dim", ff) != ff:
        c.fail("decoder_ffn_dim", f"differs from encoder_ffn_dim={ff}: one block shape per call")
    if c.get("second_expert_policy", "all") != "all":
        c.fail("second_expert_policy", "is random (only 'all' is reproducible)")
    if c.get("batch_prioritized_routing", False):
        c.fail("batch_prioritized_routing", "orders the capacity fill by importance (not offered)")
    router = dict(
        num_experts=c.get("num_experts"),
        top_k=2,
        normalize=True,
        logit_bias=bool(c.get("router_bias", False)),
        token_group="shard",
    )
    fraction = float(c.get("moe_eval_capacity_token_fraction", 1.0))
    if 0 < fraction < 1:
        c.fail(
            "moe_eval_capacity_token_fraction",
            "is in (0, 1): ceil(f * tokens) per expert is not offered",
        )
    if fraction <= 0:  # eval uses the training capacity: expert_capacity or 2 * ceil(n / E)
        if c.get("expert_capacity", None) is not None:
            router["group_capacity"] = c.get("expert_capacity")
        else:
            router["group_capacity_factor"] = 1.0
        if not c.get("normalize_router_prob_before_dropping", False):
            router["renormalize_after_drops"] = True
    # (fraction >= 1: capacity >= tokens, nothing drops and both normalisations agree.)
    dropout = float(c.get("moe_token_dropout", 0.0))
    if not 0 <= dropout < 1:
        c.fail("moe_token_dropout", "is not in [0, 1)")
    router["routed_scale"] = 1.0 - dropout  # eval scales the experts' outputs by 1 - p
    return _settings(
        c.get("d_model"),
        router,
        dict(
            d_ff=ff,
            activation=c.activation("activation_function", "relu", gated=False),
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
    if name not in FAMILIES:
        raise ValueError(
            f"unknown model_type {name!r}: jax_hybridep.nn.hf knows {sorted(FAMILIES)}"
        )
    return name


def settings(config: Mapping) -> dict:
    """{"d_model": H, "router": RouterConfig fields, "experts": ExpertConfig fields}."""
    name = model_type(config)
    return FAMILIES[name](_Config(config, name))
