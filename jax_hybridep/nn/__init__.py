"""Flax layers over dispatch/combine: router, MoE block (NNX) and a Linen wrapper; the block's
grouped settings (`RouterConfig`, `ExpertConfig`; `moe_config` checks them with the dispatch,
migration and balance values); its cross-DC migration state, prefetch and `value_and_grad`
(`migration`)."""

from jax_hybridep.nn import migration
from jax_hybridep.nn.experts import ExpertConfig, expert_swiglu, swiglu
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
    "ExpertConfig",
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
