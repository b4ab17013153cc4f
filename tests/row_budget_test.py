"""The opt-in dropless row budget (`DispatchConfig(row_budget=...)`) beyond the contract suite
(tests/contract_test.py: overflow dropped in the §2.1 order and counted, on every route kind, and
strict mode failing alike): its validation, a budget that fits equals the worst-case buffer; and
the fused weighted-combine VJP (`combine_vjp`) agreeing bitwise with the `xla` backend on
negative and non-finite weights."""

import jax.numpy as jnp
import numpy as np
import pytest
from harness import make_mesh, moe_fn
from route_kinds import bits, combine_vjp, same_bits_on

import jax_hybridep as hep

H, F = 8, 8
EP, E, T, K = 4, 8, 8, 3  # worst-case dropless C = T * EP * min(K, E_local) = 64 rows


def _problem(seed, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    n = EP * T
    idx = np.stack([rng.permutation(E)[:K] for _ in range(n)]).astype(np.int32)
    w = rng.random(idx.shape).astype(np.float32)
    x = jnp.asarray(rng.normal(size=(n, H)), dtype)
    experts = jnp.asarray(rng.normal(size=(E, H, F)) / np.sqrt(H), dtype)
    return x, idx, w, experts


def test_validation():
    with pytest.raises(ValueError, match="row_budget must be an int >= 1"):
        hep.DispatchConfig(num_experts=8, row_budget=0)
    with pytest.raises(ValueError, match="row_budget must be an int >= 1"):
        hep.DispatchConfig(num_experts=8, row_budget=2.5)
    with pytest.raises(ValueError, match="row_budget must be an int >= 1"):
        hep.DispatchConfig(num_experts=8, row_budget=True)
    with pytest.raises(ValueError, match="dropless mode only"):
        hep.DispatchConfig(num_experts=8, row_budget=16, capacity_factor=1.0)
    assert hep.DispatchConfig(num_experts=8).row_budget is None  # default: worst case


def test_budget_that_fits_matches_the_worst_case_buffer():
    x, idx, w, experts = _problem(1)
    mesh = make_mesh((EP,), ("ep",))
    topo = hep.Topology.from_mesh(mesh, ("ep",))

    def run(budget):
        cfg = hep.DispatchConfig(num_experts=E, row_budget=budget, backend="ffi")
        return moe_fn(mesh, topo, cfg)(x, idx, w, experts)

    out_budget, (rows, _, _, _, stats) = run(40)
    out_full, (full_rows, _, _, _, full_stats) = run(None)
    assert full_rows.shape == (EP, T * EP * min(K, E // EP), H) and rows.shape == (EP, 40, H)
    assert int(np.sum(stats.dropped)) == 0 == int(np.sum(full_stats.dropped))
    np.testing.assert_array_equal(bits(out_budget), bits(out_full))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("mesh_shape", [(EP,), (2, 2)], ids=["flat", "node2_local2"])
def test_weighted_combine_vjp_with_negative_and_non_finite_weights(mesh_shape, dtype):
    """combine's VJP writes rows * weights in the handlers; padding rows must hold what XLA's
    0 * weight gives (-0 for negative weights, NaN for infinite ones), bitwise."""
    names = ("ep",) if len(mesh_shape) == 1 else ("node", "local")
    mesh = make_mesh(mesh_shape, names)
    topo = hep.Topology.from_mesh(mesh, names)
    x, idx, w, _ = _problem(2, dtype)
    c = T * EP * min(K, E // EP)  # rows per shard
    rng = np.random.default_rng(3)
    y = jnp.asarray(rng.normal(size=(EP * c, H)), dtype)
    row_w = rng.normal(size=EP * c).astype(np.float32)
    row_w[c - 1 :: c] = np.inf  # the last row of every shard is padding here
    row_w[c - 2 :: c] = -1.0
    row_w[3::7] = -np.abs(row_w[3::7])

    def loss(out, x):
        return jnp.sum(out.astype(jnp.float32) ** 2)

    program = combine_vjp(mesh, topo, hep.DispatchConfig(num_experts=E), loss)
    # The host handlers' fused VJP against the reference (the contract suite runs the others).
    results = same_bits_on(("ffi",), program, x, idx, w, y, jnp.asarray(row_w))
    grad_y = np.asarray(results["ffi"][0].astype(jnp.float32)).reshape(EP, c, H)
    assert np.isnan(grad_y[:, -1]).all() and np.signbit(grad_y[:, -2]).all()
