"""The GPU route over transport v2 on fake CPU devices (jax_hybridep.exchange.cuda_v2).

The CUDA handlers cannot run here, so the route is the GPU one with `gpu_transport="v2"`: its
bottom (the routing all-gather, the layout, the record, both VJPs, row values back by XLA) issues
the custom calls through the pure-JAX twin of transport v2 (tests/transport_v2_twin.py), and the
layout is the jnp one. Everything else is the GPU path as it runs on GPUs. The contract suite
(tests/contract_test.py, route kind `gpu_v2_twin`) holds its values, gradients, rows and counted
traffic to the xla backend's bits on every case (1-, 2- and 3-level meshes, dropless, capacity,
padding, FP8 on the wire, ...: docs/design.md §2.1); here the transport's selection and where
FP8 rows are quantised.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fp8_test import FP8, _dispatch_fn, _setup
from harness import make_mesh
from route_kinds import gpu_v2_twin_route
from transport_v2_twin import JaxV2Exchanges

import jax_hybridep as hep
from jax_hybridep.exchange import cuda_bottom, cuda_v2, routes

MESHES = [((8,), ("ep",)), ((2, 4), ("node", "local")), ((2, 2, 2), ("dc", "node", "local"))]


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


# One level (v2's send quantises) and three (wire rows under the slow levels); two levels, and FP8
# values and gradients on every mesh, run in the contract suite (the `gpu_v2_twin` kind).
@pytest.mark.parametrize("mesh_index", [0, 2])
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

    route = gpu_v2_twin_route(topo, Recording())
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
