"""OLMoE (`olmoe`): softmax top-k routing, normalised when norm_topk_prob, over SwiGLU experts
stored in transformers' common per-expert layout under every decoder layer's `mlp`."""

from __future__ import annotations

from jax_hybridep.nn.hf.family import Family, every_layer, softmax_family
from jax_hybridep.nn.hf.tensor_layouts import PER_EXPERT, STACKED


def _settings(c):
    return softmax_family(
        c,
        experts_key="num_experts",
        ff_key="intermediate_size",
        normalize=c.flag("norm_topk_prob", False),
    )


FAMILIES = (
    Family(
        model_type="olmoe",
        settings=_settings,
        layer_prefixes=every_layer("model.layers.{i}.mlp"),
        layouts=(PER_EXPERT, STACKED),
        aliases=(("num_experts", "num_local_experts"),),
    ),
)
