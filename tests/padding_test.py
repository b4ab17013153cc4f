"""DispatchConfig(zero_padding=False): rows past sum(group_sizes) are unspecified and the ffi
backend does not write them; with the test switch JAX_HYBRIDEP_POISON_PADDING=1 they (and
combine's row cotangents there) hold NaN, so anything that reads them fails. The contract suite
(tests/contract_test.py: the `*_poisoned` cases) checks that the NaN reaches exactly the padding
rows and that values and gradients equal the zero-padded default bitwise, on 1-, 2- and 3-level
meshes and every route kind; here the switch's validation and MoEBlock, whose experts must never
read the padding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from harness import make_mesh

import jax_hybridep as hep
from jax_hybridep import nn as hnn


def test_poison_switch_is_validated(monkeypatch):
    monkeypatch.setenv("JAX_HYBRIDEP_POISON_PADDING", "yes")
    with pytest.raises(ValueError, match="JAX_HYBRIDEP_POISON_PADDING='yes'"):
        _ = hep.DispatchConfig(num_experts=8, zero_padding=False).poison_padding


@pytest.mark.parametrize("capacity", [None, 1.5])
def test_moe_block_ignores_poisoned_padding(monkeypatch, backend, capacity):
    """MoEBlock dispatches with zero_padding=False; its experts (ragged_dot, or the CPU capacity
    windows) never read the padding, so poisoning it changes no output or gradient bit."""
    mesh = make_mesh((2, 4), ("node", "local"))
    topo = hep.Topology.from_mesh(mesh, ("node", "local"))
    router = hnn.RouterConfig(num_experts=16, top_k=2)
    x = jnp.asarray(np.random.default_rng(5).standard_normal((8, 8, 16)), jnp.float32)

    def run():
        block = hnn.MoEBlock(
            16,
            router=router,
            experts=hnn.ExpertConfig(d_ff=32),
            mesh=mesh,
            topology=topo,
            rngs=nnx.Rngs(0),
            dispatch=hep.DispatchConfig(num_experts=16, backend=backend, capacity_factor=capacity),
        )
        assert block.dispatch_config.zero_padding is False
        graph, params = nnx.split(block)

        def loss(params, x):
            y, aux = nnx.merge(graph, params)(x)
            return jnp.sum(y**2) + aux.loss

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x)

    want = run()
    monkeypatch.setenv("JAX_HYBRIDEP_POISON_PADDING", "1")
    got = run()
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert np.isfinite(np.asarray(a)).all()
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
