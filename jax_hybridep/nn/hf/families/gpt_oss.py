"""GPT-OSS (`gpt_oss`): a router with a learned logit bias, top-k then a softmax over the k, over
clamped-SwiGLU experts with biases; gate and up interleaved (even/odd columns) in gate_up_proj
[E, H, 2F], and in the released files the expert weights in MXFP4."""

from __future__ import annotations

import dataclasses

from jax_hybridep.nn.hf.family import Family, every_layer, experts_and_top_k, settings
from jax_hybridep.nn.hf.tensor_layouts import (
    Fused,
    Mxfp4,
    TensorLayout,
    even_columns,
    fused_in_out,
    odd_columns,
)

GPT_OSS = TensorLayout(
    "interleaved gate_up_proj, biases",
    "router.weight",
    {
        **fused_in_out("experts.gate_up_proj", "experts.down_proj", interleaved=True),
        "b_gate": Fused("experts.gate_up_proj_bias", lambda e, d: (e, 2 * d["F"]), even_columns),
        "b_up": Fused("experts.gate_up_proj_bias", lambda e, d: (e, 2 * d["F"]), odd_columns),
        "b_down": Fused("experts.down_proj_bias", lambda e, d: (e, d["H"]), lambda a, d: a),
    },
    logit_bias="router.bias",
)
# The released GPT-OSS files: the expert weights in MXFP4 (in must be a multiple of 32).
GPT_OSS_MXFP4 = dataclasses.replace(
    GPT_OSS,
    name="mxfp4 gate_up/down_proj_blocks, biases",
    experts={
        **GPT_OSS.experts,
        "w_gate": Mxfp4(
            "experts.gate_up_proj", lambda d: 2 * d["F"], lambda d: d["H"], even_columns
        ),
        "w_up": Mxfp4("experts.gate_up_proj", lambda d: 2 * d["F"], lambda d: d["H"], odd_columns),
        "w_down": Mxfp4("experts.down_proj", lambda d: d["H"], lambda d: d["F"], lambda a, d: a),
    },
)


def _gpt_oss(c):
    num_experts, top_k = experts_and_top_k(c, "num_local_experts")
    return settings(
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


FAMILIES = (
    Family(
        model_type="gpt_oss",
        settings=_gpt_oss,
        layer_prefixes=every_layer("model.layers.{i}.mlp"),
        layouts=(GPT_OSS, GPT_OSS_MXFP4),
        # OpenAI's own config.json says experts_per_token.
        aliases=(
            ("num_local_experts", "num_experts"),
            ("num_experts_per_tok", "experts_per_token"),
        ),
    ),
)
