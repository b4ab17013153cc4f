"""Llama-4 (`llama4`, and its text model alone, `llama4_text`): sigmoid top-k routing without
normalisation, the routing weight applied to the expert's input, a shared expert as wide as the
routed ones; experts fused as gate_up_proj [E, H, 2F]. A `llama4` config holds its text settings
in `text_config` (or, flat, at the top); its layers sit under `language_model`."""

from __future__ import annotations

from jax_hybridep.nn.hf.config_fields import Config
from jax_hybridep.nn.hf.family import GATED_ACTIVATIONS, Family, experts_and_top_k, layers, settings
from jax_hybridep.nn.hf.tensor_layouts import TensorLayout, fused_in_out

LLAMA4 = TensorLayout(
    "fused gate_up_proj [E, H, 2F]",
    "router.weight",
    fused_in_out("experts.gate_up_proj", "experts.down_proj", interleaved=False),
    shared="shared_expert",
)


def text_config(c: Config) -> Config:
    """Llama-4's text settings: `text_config` of a `llama4` config, or (flat) the config itself."""
    return c.nested("text_config") if "text_config" in c.config else c


def _llama4(c):
    text = text_config(c)
    num_experts, top_k = experts_and_top_k(text, "num_local_experts")
    d_ff = text.integer("intermediate_size")
    return settings(
        text.integer("hidden_size"),
        dict(num_experts=num_experts, top_k=top_k, score_fn="sigmoid", normalize=False),
        dict(
            d_ff=d_ff,
            activation=text.activation("hidden_act", "silu", GATED_ACTIVATIONS),
            shared_ff=d_ff,
            weight_input=True,
        ),
    )


def _layer_prefixes(base: str, nested: bool):
    """The `feed_forward` of `moe_layers` (default: every interleave_moe_layer_step-th layer, the
    last of each step) under `base`; `nested`: the text settings as `_llama4` reads them."""

    def prefixes(c):
        text = text_config(c) if nested else c
        step = text.integer("interleave_moe_layer_step", 1)
        moe = text.integers("moe_layers", None) if text.has("moe_layers") else None
        if moe is None:  # HF's default: every step-th layer, the last of each step
            moe = range(step - 1, text.integer("num_hidden_layers", low=0), step)
        moe = set(moe)
        return layers(text, base + "feed_forward", lambda i: i in moe, "num_hidden_layers")

    return prefixes


FAMILIES = (
    Family(
        model_type="llama4",
        settings=_llama4,
        layer_prefixes=_layer_prefixes("language_model.model.layers.{i}.", nested=True),
        layouts=(LLAMA4,),
        aliases=(),
    ),
    Family(
        model_type="llama4_text",
        settings=_llama4,
        layer_prefixes=_layer_prefixes("model.layers.{i}.", nested=False),
        layouts=(LLAMA4,),
        aliases=(),
    ),
)
