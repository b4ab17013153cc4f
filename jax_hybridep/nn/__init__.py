"""Flax layers over dispatch/combine: router, MoE block (NNX) and a Linen wrapper."""

from jax_hybridep.nn.experts import expert_swiglu, swiglu
from jax_hybridep.nn.moe import COMBINE_NAME, DISPATCH_NAME, MoEAux, MoEBlock
from jax_hybridep.nn.router import Router, RouterBias, RouterConfig, RouterOutput, route

__all__ = [
    "COMBINE_NAME",
    "DISPATCH_NAME",
    "MoEAux",
    "MoEBlock",
    "Router",
    "RouterBias",
    "RouterConfig",
    "RouterOutput",
    "expert_swiglu",
    "route",
    "swiglu",
]
