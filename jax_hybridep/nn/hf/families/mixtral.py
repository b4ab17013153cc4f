"""Mixtral (`mixtral`): softmax top-k routing, normalised, over SwiGLU experts stored per expert
as w1/w3/w2 under every decoder layer's `block_sparse_moe`."""

from __future__ import annotations

from jax_hybridep.nn.hf.family import Family, every_layer, softmax_family
from jax_hybridep.nn.hf.tensor_layouts import STACKED, TensorLayout, per_expert

MIXTRAL = TensorLayout(
    "per-expert w1/w3/w2",
    "gate.weight",
    per_expert("experts.{i}.w1.weight", "experts.{i}.w3.weight", "experts.{i}.w2.weight"),
)


def _settings(c):
    return softmax_family(
        c, experts_key="num_local_experts", ff_key="intermediate_size", normalize=True
    )


FAMILIES = (
    Family(
        model_type="mixtral",
        settings=_settings,
        layer_prefixes=every_layer("model.layers.{i}.block_sparse_moe"),
        layouts=(MIXTRAL, STACKED),
        aliases=(("num_local_experts", "num_experts"),),
    ),
)
