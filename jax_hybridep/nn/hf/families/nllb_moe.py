"""NLLB-MoE (`nllb_moe`): top-2 softmax routing, normalised, with an optional router bias, the
eval capacity and renormalisation of HF's `model.eval()` and outputs scaled by
1 - moe_token_dropout; non-gated experts (fc1/fc2) with biases in every sparse_step-th encoder
and decoder layer."""

from __future__ import annotations

from jax_hybridep.nn.hf.family import PLAIN_ACTIVATIONS, Family, layers, settings
from jax_hybridep.nn.hf.tensor_layouts import PerExpert, TensorLayout

NLLB = TensorLayout(
    "per-expert fc1/fc2, biases",
    "router.classifier.weight",
    {
        "w_up": PerExpert("experts.expert_{i}.fc1.weight"),
        "w_down": PerExpert("experts.expert_{i}.fc2.weight"),
        "b_up": PerExpert("experts.expert_{i}.fc1.bias", transpose=False),
        "b_down": PerExpert("experts.expert_{i}.fc2.bias", transpose=False),
    },
    logit_bias="router.classifier.bias",
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
    return settings(
        c.integer("d_model"),
        router,
        dict(
            d_ff=ff,
            activation=c.activation("activation_function", "relu", PLAIN_ACTIVATIONS),
            expert_bias=True,
        ),
    )


def _sparse(step):
    """Layers with (i + 1) % step == 0; none when step is 0."""
    return lambda i: step > 0 and (i + 1) % step == 0


def _layer_prefixes(c):
    return layers(
        c,
        "model.encoder.layers.{i}.ffn",
        _sparse(c.integer("encoder_sparse_step", low=0)),
        "encoder_layers",
    ) + layers(
        c,
        "model.decoder.layers.{i}.ffn",
        _sparse(c.integer("decoder_sparse_step", low=0)),
        "decoder_layers",
    )


FAMILIES = (
    Family(
        model_type="nllb_moe",
        settings=_nllb_moe,
        layer_prefixes=_layer_prefixes,
        layouts=(NLLB,),
        aliases=(("d_model", "hidden_size"), ("encoder_layers", "num_hidden_layers")),
    ),
)
