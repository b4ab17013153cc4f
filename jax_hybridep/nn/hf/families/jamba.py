"""Jamba (`jamba`): softmax top-k routing without normalisation over SwiGLU experts, a
`router.weight` gate, MoE in every expert_layer_period-th layer's `feed_forward`."""

from __future__ import annotations

import dataclasses

from jax_hybridep.nn.hf.family import Family, layers, softmax_family
from jax_hybridep.nn.hf.tensor_layouts import PER_EXPERT, STACKED

JAMBA = dataclasses.replace(
    PER_EXPERT,
    name="per-expert, router.weight",
    router="router.weight",
    shared=None,
    shared_gate=None,
)
JAMBA_STACKED = dataclasses.replace(
    STACKED, name="stacked, router.weight", router="router.weight", shared=None, shared_gate=None
)


def _settings(c):
    return softmax_family(c, experts_key="num_experts", ff_key="intermediate_size", normalize=False)


def _layer_prefixes(c):
    period = c.integer("expert_layer_period")
    offset = c.integer("expert_layer_offset", low=0, high=period - 1)
    sparse = c.integer("num_experts") > 1  # one expert: every layer is a dense MLP
    return layers(
        c,
        "model.layers.{i}.feed_forward",
        lambda i: sparse and i % period == offset,
        "num_hidden_layers",
    )


FAMILIES = (
    Family(
        model_type="jamba",
        settings=_settings,
        layer_prefixes=_layer_prefixes,
        layouts=(JAMBA, JAMBA_STACKED),
        aliases=(("num_experts", "num_local_experts"),),
    ),
)
