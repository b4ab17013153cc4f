"""The GPU route's composition on fake CPU devices (jax_hybridep.exchange.cuda_bottom).

The CUDA handlers cannot run here, so the route is the GPU one with the CUDA bottom issuing its
exchanges through a pure-JAX twin (tests/transport_twin.py) and the jnp layout; everything else
is the GPU path as it runs on GPUs: slow levels walked with XLA all-to-alls, the bottom spanning
the fastest level, the handle's receive map, combine and both VJPs. Values and gradients must
equal the xla backend's bit for bit (the kernels themselves are checked against the same order
on a GPU, in tests/cuda_transport_test.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import make_mesh, moe_fn, random_routing
from transport_twin import JaxExchanges

import jax_hybridep as hep
from jax_hybridep.exchange import cuda_bottom, layouts, routes


def _twin_route(topo: hep.Topology) -> routes.Route:
    """The GPU route, its CUDA bottom's exchanges and layout swapped for pure-JAX ones."""
    gpu = routes.route_for("ffi", topo)
    assert isinstance(gpu.bottom, cuda_bottom.CudaBottom)
    twin = cuda_bottom.CudaBottom(exchanges=JaxExchanges())
    return dataclasses.replace(gpu, layout=layouts.JnpLayout(), bottom=twin)


def _run(mesh, topo, backend, dtype, capacity, weighted, rng):
    n, T, H, K, E = mesh.size, 12, 16, 3, 2 * mesh.size
    idx, w = random_routing(rng, n * T, K, E, invalid_fraction=0.1)
    x = rng.standard_normal((n * T, H)).astype(np.float32)
    experts = (rng.standard_normal((E, H, H)) * 0.1).astype(np.float32)
    x, experts = jnp.asarray(x, dtype), jnp.asarray(experts, dtype)
    cfg = hep.DispatchConfig(num_experts=E, capacity_factor=capacity, backend=backend)
    route = _twin_route(topo) if backend == "ffi" else None
    fn = moe_fn(mesh, topo, cfg, weighted_combine=weighted, route=route)

    def loss(x, w):
        out, stacked = fn(x, idx, w, experts)
        return jnp.sum(out.astype(jnp.float32) ** 2), (out, stacked)

    # One program for values and gradients.
    (_, (out, stacked)), grads = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(x, w)
    return jax.device_get((out, stacked, grads))


def _bits(tree):
    return [np.asarray(a).view(np.uint8) for a in jax.tree.leaves(tree)]


SHAPES = [((8,), ("ep",)), ((2, 4), ("node", "local")), ((2, 2, 2), ("dc", "node", "local"))]
VARIANTS = [(jnp.float32, True), (jnp.float32, False), (jnp.bfloat16, False)]  # dtype, weighted


# Every mesh with every (dtype, weighted) variant, dropless and capacity alternating between
# them so each mesh and each variant meets both.
@pytest.mark.parametrize(
    "shape,levels,capacity,dtype,weighted",
    [
        (*SHAPES[i], (None, 1.0)[(i + j) % 2], *VARIANTS[j])
        for i in range(len(SHAPES))
        for j in range(len(VARIANTS))
    ],
)
def test_gpu_path_matches_xla_backend(shape, levels, capacity, weighted, dtype):
    mesh = make_mesh(shape, levels)
    topo = dataclasses.replace(hep.Topology.from_mesh(mesh, levels), platform="gpu")
    results = {}
    for backend in ("ffi", "xla"):
        results[backend] = _run(mesh, topo, backend, dtype, capacity, weighted,
                                np.random.default_rng(7))  # fmt: skip
    for got, want in zip(_bits(results["ffi"]), _bits(results["xla"]), strict=True):
        np.testing.assert_array_equal(got, want)
