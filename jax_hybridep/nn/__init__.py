"""Flax layers over dispatch/combine: router, MoE block (NNX) and a Linen wrapper; the MoE block's
cross-DC migration state, prefetch and `value_and_grad` (`migration`)."""

from jax_hybridep.nn import migration
from jax_hybridep.nn.experts import expert_swiglu, swiglu
from jax_hybridep.nn.migration import (
    Gathered,
    GradFeedback,
    SRReference,
    prefetch_experts,
    value_and_grad,
)
from jax_hybridep.nn.moe import COMBINE_NAME, DISPATCH_NAME, MoEAux, MoEBlock
from jax_hybridep.nn.router import Router, RouterBias, RouterConfig, RouterOutput, route

__all__ = [
    "COMBINE_NAME",
    "DISPATCH_NAME",
    "Gathered",
    "GradFeedback",
    "MoEAux",
    "MoEBlock",
    "Router",
    "RouterBias",
    "RouterConfig",
    "RouterOutput",
    "SRReference",
    "expert_swiglu",
    "migration",
    "prefetch_experts",
    "route",
    "swiglu",
    "value_and_grad",
]
