"""The routing-weight gradient's fixed summation order (jax_hybridep/weight_grad.py): the XLA
expression equals its numpy statement bit for bit, it is a true dot product, and the host
handlers' fused combine VJP (xla_ffi/common/numeric.h, RowDotT) gives the same bits as the `xla`
backend for hidden sizes that exercise every branch (fewer than 16 lanes, one or several blocks
of 16 lanes, whole steps, a tail)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import make_mesh
from route_kinds import ROUTES, bits, combine_vjp, on_mesh, same_bits_on

import jax_hybridep as hep
from jax_hybridep import weight_grad

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def test_lanes():
    got = {h: weight_grad.lanes(h) for h in (1, 15, 16, 17, 1000, 1024, 1025, 2048, 7168)}
    assert got == {1: 1, 15: 15, 16: 16, 17: 16, 1000: 16, 1024: 16, 1025: 32, 2048: 32, 7168: 112}


def _rows(rng, c, hidden, dtype, special=True):
    y = rng.normal(size=(c, hidden)).astype(np.float32)
    g = rng.normal(size=(c, hidden)).astype(np.float32)
    if special:
        y[0] = -np.abs(y[0])  # with g = 0 below: every product -0, so the sum is -0
        g[0] = 0.0
        y[1, hidden // 2] = np.inf  # inf * g: +-inf, or NaN where g is 0
        g[2, -1] = np.nan
        y[3] = 1e-20  # tiny products (normal in float32: XLA on CPU flushes subnormals)
        g[3] = 1e-15
    return jnp.asarray(y, dtype), jnp.asarray(g, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [1, 7, 16, 33, 1000, 1040, 2100, 7168])
def test_xla_order_is_the_numpy_order_bitwise(hidden, dtype):
    y, g = _rows(np.random.default_rng(hidden), 6, hidden, DTYPES[dtype])
    got = np.asarray(jax.jit(weight_grad.fixed_order_dot)(y, g))
    want = weight_grad.fixed_order_dot_numpy(
        np.asarray(y.astype(jnp.float32)), np.asarray(g.astype(jnp.float32))
    )
    np.testing.assert_array_equal(bits(got), bits(want))
    assert np.signbit(got[0]) and got[0] == 0.0
    assert np.isnan(got[2])


@pytest.mark.parametrize("hidden", [5, 1000, 7168])
def test_fixed_order_is_a_dot_product(hidden):
    y, g = _rows(np.random.default_rng(0), 16, hidden, jnp.float32, special=False)
    got = np.asarray(jax.jit(weight_grad.fixed_order_dot)(y, g))
    want = np.sum(np.asarray(y, np.float64) * np.asarray(g, np.float64), axis=1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(hidden))


def test_other_platforms_use_xla_reduction():
    y, g = _rows(np.random.default_rng(1), 4, 64, jnp.float32, special=False)
    want = jnp.sum(y * g, axis=1)
    np.testing.assert_array_equal(weight_grad.row_dot("gpu", y, g), want)


EP, E, T, K = 4, 8, 6, 3


def _mesh(mesh_shape):
    names = ("ep",) if len(mesh_shape) == 1 else ("node", "local")
    mesh = make_mesh(mesh_shape, names)
    return mesh, hep.Topology.from_mesh(mesh, names)


MESH_SHAPES = {"flat": (EP,), "node2_local2": (2, 2)}  # the fused and the walked host route


# Every hidden size with both dtypes, the two meshes alternating between them (the lanes of
# RowDotT depend on the hidden size and dtype; the mesh picks the fused or the walked route).
@pytest.mark.parametrize(
    "mesh_name,hidden,dtype",
    [
        (("flat", "node2_local2")[(i + j) % 2], hidden, dtype)
        for i, hidden in enumerate([5, 16, 40, 1040, 2100])
        for j, dtype in enumerate(["float32", "bfloat16"])
    ],
)
def test_ffi_weight_gradient_is_the_xla_backends_bitwise(mesh_name, hidden, dtype):
    """Gradients of y and of the combine weights (padding rows included: their dot is with a
    row of zeros) from the fused host VJP equal the xla backend's, bit for bit."""
    dtype = DTYPES[dtype]
    mesh, topo = _mesh(MESH_SHAPES[mesh_name])
    rng = np.random.default_rng(hidden)
    idx = np.stack([rng.permutation(E)[:K] for _ in range(EP * T)]).astype(np.int32)
    idx[::5, 2] = -1
    w = rng.random(idx.shape).astype(np.float32)
    x = jnp.asarray(rng.normal(size=(EP * T, hidden)), dtype)
    c = T * EP * min(K, E // EP)  # dropless rows per shard; some are padding
    y, _ = _rows(rng, EP * c, hidden, dtype)
    y = y.at[c - 1 :: c].set(-1.0)  # the last row of each shard is padding: its dot is -0
    # Products of this row with g (~1e-12) are subnormal: XLA's CPU runtime flushes them to zero,
    # and the handlers' worker threads run under the calling thread's floating-point mode.
    y = y.at[5].multiply(1e-30)
    row_w = jnp.asarray(rng.normal(size=EP * c).astype(np.float32))

    def loss(out, x):
        return jnp.sum(out.astype(jnp.float32) * jnp.cos(x.astype(jnp.float32))) * 1e-12

    program = combine_vjp(mesh, topo, hep.DispatchConfig(num_experts=E), loss)
    results = same_bits_on(("ffi",), program, x, idx, w, y, row_w)
    grad_w = np.asarray(results["ffi"][1]).reshape(EP, c)
    assert np.signbit(grad_w[:, -1]).all() and (grad_w[:, -1] == 0).all()
    assert np.abs(grad_w).max() > 0  # the gradient is not trivially zero


@pytest.mark.parametrize("mesh_name", sorted(MESH_SHAPES))
def test_unweighted_combine_of_signed_zeros_and_nans_is_the_xla_backends_bitwise(mesh_name):
    """An unweighted partial of one row is added without its rounding step on the host (0 + x
    rounded back is x except -0 -> +0, which adds the same); -0 and NaN rows check that claim."""
    mesh, topo = _mesh(MESH_SHAPES[mesh_name])
    rng = np.random.default_rng(7)
    idx = np.stack([rng.permutation(E)[:K] for _ in range(EP * T)]).astype(np.int32)
    w = rng.random(idx.shape).astype(np.float32)
    x = jnp.asarray(rng.normal(size=(EP * T, 8)), jnp.bfloat16)
    c = T * EP * min(K, E // EP)
    y = rng.normal(size=(EP * c, 8)).astype(np.float32)
    y[::3] = -0.0
    y[1::7, 2] = np.nan
    y[2::5, 3] = -np.inf
    y = jnp.asarray(y, jnp.bfloat16)

    def program(kind):
        cfg = hep.DispatchConfig(num_experts=E)

        def step(x, idx, w, y):
            d = ROUTES[kind].dispatch(x, idx, w, topology=topo, config=cfg)
            return hep.combine(y, d.handle)

        return on_mesh(mesh, step, num_args=4)

    out = np.asarray(same_bits_on(("ffi",), program, x, idx, w, y)["ffi"].astype(np.float32))
    assert (out == 0).any() and not np.signbit(out[out == 0]).any()  # -0 rows sum to +0
