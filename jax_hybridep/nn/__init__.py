"""Flax layers over dispatch/combine: router, MoE block (NNX) and a Linen wrapper; the block's
grouped settings (`RouterConfig`, `ExpertConfig`; `moe_config` checks them with the dispatch,
migration and balance values); its cross-DC migration state, prefetch and `value_and_grad`
(`migration_state`); HuggingFace MoE families' configs and checkpoints (`hf`)."""

from jax_hybridep.nn import hf, migration_state
from jax_hybridep.nn.experts import (
    ACTIVATIONS,
    FFN,
    ExpertConfig,
    expert_ffn,
    expert_swiglu,
    swiglu,
)
from jax_hybridep.nn.migration_state import (
    Gathered,
    GradFeedback,
    SRReference,
    prefetch_experts,
    value_and_grad,
)
from jax_hybridep.nn.moe import COMBINE_NAME, DISPATCH_NAME, MoEAux, MoEBlock
from jax_hybridep.nn.router import Router, RouterBias, RouterConfig, RouterOutput, route

__all__ = [
    "ACTIVATIONS",
    "COMBINE_NAME",
    "DISPATCH_NAME",
    "FFN",
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
    "expert_ffn",
    "expert_swiglu",
    "hf",
    "migration_state",
    "prefetch_experts",
    "route",
    "swiglu",
    "value_and_grad",
]
