"""A thin Flax Linen wrapper of the NNX MoE block, for Linen models.

    moe = MoEBlockLinen(d_model=..., router=..., experts=..., topology=..., dispatch=...)
    variables = moe.init(jax.random.key(0), x)
    y, aux = moe.apply(variables, x)

Parameters live in the "params" collection; the auxiliary-loss-free router bias in its own
collection (named after `RouterBias`), updated with `apply(..., method=...)` or by hand.
"""

from __future__ import annotations

from flax import nnx

from jax_hybridep.nn.moe import MoEBlock


def MoEBlockLinen(**kwargs):  # noqa: N802  (a Linen module factory reads like a class)
    """Linen module running `MoEBlock(**kwargs)`; call it as `(x) -> (y, MoEAux)`."""
    return nnx.bridge.to_linen(MoEBlock, **kwargs)
