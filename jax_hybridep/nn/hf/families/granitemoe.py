"""Granite-MoE (`granitemoe`): top-k of the logits then a softmax over the k (the normalised
top-k of the softmax) over SwiGLU experts fused as input_linear [E, 2F, H] / output_linear."""

from __future__ import annotations

from jax_hybridep.nn.hf.family import Family, every_layer, softmax_family
from jax_hybridep.nn.hf.tensor_layouts import TensorLayout, stacked

GRANITE = TensorLayout(
    "input_linear [E, 2F, H]",
    "router.layer.weight",
    stacked("input_linear.weight", "output_linear.weight"),
)


def _settings(c):
    # Top-k of the logits, then a softmax over the k: the normalised top-k of the softmax.
    return softmax_family(
        c, experts_key="num_local_experts", ff_key="intermediate_size", normalize=True
    )


FAMILIES = (
    Family(
        model_type="granitemoe",
        settings=_settings,
        layer_prefixes=every_layer("model.layers.{i}.block_sparse_moe"),
        layouts=(GRANITE,),
        aliases=(),
    ),
)
