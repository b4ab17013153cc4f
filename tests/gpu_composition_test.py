"""The GPU path's composition on fake CPU devices (jax_hybridep.backends.ffi_gpu).

The CUDA handlers cannot run here, so their exchanges are swapped for a pure-JAX twin
(tests/transport_twin.py) and the layout for the xla backend's; everything else is the GPU path as
it runs on GPUs: slow levels walked with XLA all-to-alls, the transport over the fastest level,
the handle's receive map, combine and both VJPs. Values and gradients must equal the xla
backend's bit for bit (the kernels themselves are checked against the same order on a GPU, in
tests/cuda_transport_test.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import make_mesh, moe_fn, random_routing
from transport_twin import JaxTransport

import jax_hybridep as hep
from jax_hybridep.backends import ffi_gpu, xla

pytestmark = pytest.mark.skipif(
    "gpu" not in hep._native.platforms(), reason="built without the CUDA handlers"
)


@pytest.fixture
def twin(monkeypatch):
    monkeypatch.setattr(ffi_gpu, "TRANSPORT", JaxTransport())
    monkeypatch.setattr(ffi_gpu, "layout", xla.layout)


def _run(mesh, topo, backend, dtype, capacity, weighted, rng):
    n, T, H, K, E = mesh.size, 12, 16, 3, 2 * mesh.size
    idx, w = random_routing(rng, n * T, K, E, invalid_fraction=0.1)
    x = rng.standard_normal((n * T, H)).astype(np.float32)
    experts = (rng.standard_normal((E, H, H)) * 0.1).astype(np.float32)
    x, experts = jnp.asarray(x, dtype), jnp.asarray(experts, dtype)
    cfg = hep.DispatchConfig(num_experts=E, capacity_factor=capacity, backend=backend)
    fn = moe_fn(mesh, topo, cfg, weighted_combine=weighted)

    def loss(x, w):
        return jnp.sum(fn(x, idx, w, experts)[0].astype(jnp.float32) ** 2)

    out, stacked = fn(x, idx, w, experts)
    grads = jax.grad(loss, argnums=(0, 1))(x, w)
    return jax.device_get((out, stacked, grads))


def _bits(tree):
    return [np.asarray(a).view(np.uint8) for a in jax.tree.leaves(tree)]


@pytest.mark.parametrize(
    "shape,levels",
    [((8,), ("ep",)), ((2, 4), ("node", "local")), ((2, 2, 2), ("dc", "node", "local"))],
)
@pytest.mark.parametrize("capacity", [None, 1.0])
@pytest.mark.parametrize(
    "dtype,weighted", [(jnp.float32, True), (jnp.float32, False), (jnp.bfloat16, False)]
)
def test_gpu_path_matches_xla_backend(twin, shape, levels, capacity, weighted, dtype):
    mesh = make_mesh(shape, levels)
    topo = dataclasses.replace(hep.Topology.from_mesh(mesh, levels), platform="gpu")
    results = {}
    for backend in ("ffi", "xla"):
        results[backend] = _run(mesh, topo, backend, dtype, capacity, weighted,
                                np.random.default_rng(7))  # fmt: skip
    for got, want in zip(_bits(results["ffi"]), _bits(results["xla"]), strict=True):
        np.testing.assert_array_equal(got, want)
