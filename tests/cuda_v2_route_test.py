"""The GPU route over transport v2 on fake CPU devices (jax_hybridep.exchange.cuda_v2).

The CUDA handlers cannot run here, so the route is the GPU one with `gpu_transport="v2"`: its
bottom (the routing all-gather, the layout, the record, both VJPs, row values back by XLA) issues
the custom calls through the pure-JAX twin of transport v2 (tests/transport_v2_twin.py), and the
layout is the jnp one. Everything else is the GPU path as it runs on GPUs. Values, gradients, FP8
rows and the counted traffic must equal the xla backend's bit for bit, on 1-, 2- and 3-level
meshes, dropless and with a capacity (docs/design.md §2.1).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fp8_test import FP8, _dispatch_fn, _setup
from harness import make_mesh, moe_fn, random_routing
from transport_v2_twin import JaxV2Exchanges

import jax_hybridep as hep
from jax_hybridep.exchange import cuda_bottom, cuda_v2, layouts, routes

MESHES = [((8,), ("ep",)), ((2, 4), ("node", "local")), ((2, 2, 2), ("dc", "node", "local"))]


def _twin_route(topo: hep.Topology) -> routes.Route:
    """The GPU route over transport v2, its custom calls and layout swapped for pure-JAX ones."""
    gpu = routes.route_for("ffi", topo, gpu_transport="v2")
    assert isinstance(gpu.bottom, cuda_v2.CudaV2Bottom)
    twin = cuda_v2.CudaV2Bottom(exchanges=JaxV2Exchanges())
    return dataclasses.replace(gpu, layout=layouts.JnpLayout(), bottom=twin)


def test_gpu_transport_selects_the_bottom():
    names = ("node", "local")
    topo = hep.Topology.from_mesh(make_mesh((2, 4), names), names)
    topo = dataclasses.replace(topo, platform="gpu")
    assert isinstance(routes.route_for("ffi", topo).bottom, cuda_bottom.CudaBottom)
    assert isinstance(routes.route_for("ffi", topo, "v2").bottom, cuda_v2.CudaV2Bottom)
    with pytest.raises(ValueError, match="gpu_transport must be one of"):
        hep.DispatchConfig(num_experts=8, gpu_transport="v3")
    with pytest.raises(ValueError, match="gpu_transport must be one of"):
        hep.DispatchConfig(num_experts=8, gpu_transport=2)


def _run(mesh, topo, backend, dtype, capacity, weighted, zero_padding, rng):
    n, T, H, K, E = mesh.size, 12, 16, 3, 2 * mesh.size
    idx, w = random_routing(rng, n * T, K, E, invalid_fraction=0.1)
    idx[::5, 1] = idx[::5, 0]  # repeated ids: one row per (t, k), one copy per GPU
    x = rng.standard_normal((n * T, H)).astype(np.float32)
    experts = (rng.standard_normal((E, H, H)) * 0.1).astype(np.float32)
    x, experts = jnp.asarray(x, dtype), jnp.asarray(experts, dtype)
    cfg = hep.DispatchConfig(num_experts=E, capacity_factor=capacity, backend=backend,
                             gpu_transport="v2", zero_padding=zero_padding)  # fmt: skip
    route = _twin_route(topo) if backend == "ffi" else None
    fn = moe_fn(mesh, topo, cfg, weighted_combine=weighted, route=route)

    def loss(x, w):
        out, stacked = fn(x, idx, w, experts)
        return jnp.sum(out.astype(jnp.float32) ** 2), (out, stacked)

    (_, (out, stacked)), grads = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(x, w)
    return jax.device_get((out, stacked, grads))


def _bits(tree):
    return [np.asarray(a).view(np.uint8) for a in jax.tree.leaves(tree)]


# Each mesh meets each variant: (dtype, weighted, capacity, zero_padding).
VARIANTS = [(jnp.float32, True, None, True), (jnp.bfloat16, False, 1.0, True),
            (jnp.float32, True, 1.0, False)]  # fmt: skip


@pytest.mark.parametrize("mesh_index", range(len(MESHES)))
def test_v2_route_matches_xla_backend(mesh_index):
    shape, levels = MESHES[mesh_index]
    dtype, weighted, capacity, zero_padding = VARIANTS[mesh_index]
    mesh = make_mesh(shape, levels)
    topo = dataclasses.replace(hep.Topology.from_mesh(mesh, levels), platform="gpu")
    results = {}
    for backend in ("ffi", "xla"):
        results[backend] = _run(mesh, topo, backend, dtype, capacity, weighted, zero_padding,
                                np.random.default_rng(7))  # fmt: skip
    got, want = jax.tree.map(np.array, (results["ffi"], results["xla"]))
    if not zero_padding:  # rows past sum(group_sizes) are unspecified: compare the others
        tokens, row_end = got[1][0], np.sum(got[1][2], axis=-1)
        for shard in range(tokens.shape[0]):
            tokens[shard, row_end[shard] :] = want[1][0][shard, row_end[shard] :]
    for a, b in zip(_bits(got), _bits(want), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("mesh_index", range(len(MESHES)))
def test_v2_route_carries_fp8_like_the_xla_backend(mesh_index):
    """On one level the tokens reach the v2 send unquantised (it quantises), under slower levels
    as wire rows; rows (dequantised, or FP8 with scales), row weights and traffic bitwise."""
    shape, names = MESHES[mesh_index]
    mesh, topo, x, idx, w, kw = _setup(shape, names, (200, 256, 198)[mesh_index], capacity=1.0)
    gpu_topo = dataclasses.replace(topo, platform="gpu")
    reached = []

    class Recording(JaxV2Exchanges):
        def dispatch(self, plan, fast, x, lay):
            reached.append(x.dtype)
            return super().dispatch(plan, fast, x, lay)

    route = dataclasses.replace(_twin_route(gpu_topo), bottom=cuda_v2.CudaV2Bottom(Recording()))
    for rows in (False, True):
        cfg = hep.DispatchConfig(backend="ffi", wire_dtype=FP8, fp8_rows=rows,
                                 gpu_transport="v2", **kw)  # fmt: skip
        got = jax.device_get(_dispatch_fn(mesh, gpu_topo, cfg, route=route)(x, idx, w))
        assert reached[-1] == (x.dtype if len(names) == 1 else jnp.uint8)
        xla = dataclasses.replace(cfg, backend="xla")
        want = jax.device_get(_dispatch_fn(mesh, topo, xla)(x, idx, w))
        for a, b in zip(got, want, strict=True):
            if b is not None:
                np.testing.assert_array_equal(np.asarray(a).view(np.uint8),
                                              np.asarray(b).view(np.uint8))  # fmt: skip
