"""Granite-MoE (`granitemoe`): top-k of the logits then a softmax over the k (the normalised
top-k of the softmax) over SwiGLU experts fused as input_linear [E, 2F, H] / output_linear."""

from __future__ import annotations

from jax_hybridep.nn.hf.family import Family, layers, softmax_family
from jax_hybridep.nn.hf.tensor_layouts import Layout, stacked

GRANITE = Layout(
    "input_linear [E, 2F, H]",
    "router.layer.weight",
    stacked("input_linear.weight", "output_linear.weight"),
)


def _settings(c):
    # Top-k of the logits, then a softmax over the k: the normalised top-k of the softmax.
    return softmax_family(
        c, experts_key="num_local_experts", ff_key="intermediate_size", normalize=True
    )


def _layer_prefixes(c):
    return layers(c, "model.layers.{i}.block_sparse_moe", lambda i: True, "num_hidden_layers")


FAMILIES = (
    Family(
        model_type="granitemoe",
        settings=_settings,
        layer_prefixes=_layer_prefixes,
        layouts=(GRANITE,),
        aliases=(),
    ),
)
