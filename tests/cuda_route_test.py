"""The GPU route on fake CPU devices (jax_hybridep.exchange.cuda).

The CUDA handlers cannot run here, so the route is the GPU one with its bottom (the routing
all-gather, the slot map, the record, both VJPs, row values back by XLA) issuing the custom calls
through the pure-JAX twin of the transport (tests/transport_twin.py), and the layout is the jnp
one. Everything else is the GPU path as it runs on GPUs. The contract suite
(tests/contract_test.py, route kind `gpu_twin`) holds its values, gradients, rows and counted
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
from route_kinds import gpu_twin_route
from transport_twin import JaxExchanges

import jax_hybridep as hep
from jax_hybridep.exchange import cuda, routes

MESHES = [((8,), ("ep",)), ((2, 4), ("node", "local")), ((2, 2, 2), ("dc", "node", "local"))]


def test_gpu_route_spans_the_fastest_level_with_the_cuda_bottom():
    names = ("node", "local")
    topo = hep.Topology.from_mesh(make_mesh((2, 4), names), names)
    route = routes.route_for("ffi", dataclasses.replace(topo, platform="gpu"))
    assert isinstance(route.bottom, cuda.CudaBottom) and len(route.levels) == 1
    # One transport: no switch left to name another.
    assert "gpu_transport" not in {f.name for f in dataclasses.fields(hep.DispatchConfig)}


# One level (the send quantises) and three (wire rows under the slow levels); two levels, and FP8
# values and gradients on every mesh, run in the contract suite (the `gpu_twin` kind).
@pytest.mark.parametrize("mesh_index", [0, 2])
def test_gpu_route_carries_fp8_like_the_xla_backend(mesh_index):
    """On one level the tokens reach the send unquantised (it quantises), under slower levels
    as wire rows; rows (dequantised, or FP8 with scales), row weights and traffic bitwise."""
    shape, names = MESHES[mesh_index]
    mesh, topo, x, idx, w, kw = _setup(shape, names, (200, 256, 198)[mesh_index], capacity=1.0)
    gpu_topo = dataclasses.replace(topo, platform="gpu")
    reached = []

    class Recording(JaxExchanges):
        def dispatch(self, plan, fast, x, lay):
            reached.append(x.dtype)
            return super().dispatch(plan, fast, x, lay)

    route = gpu_twin_route(topo, Recording())
    for rows in (False, True):
        cfg = hep.DispatchConfig(backend="ffi", wire_dtype=FP8, fp8_rows=rows, **kw)
        got = jax.device_get(_dispatch_fn(mesh, gpu_topo, cfg, route=route)(x, idx, w))
        assert reached[-1] == (x.dtype if len(names) == 1 else jnp.uint8)
        xla = dataclasses.replace(cfg, backend="xla")
        want = jax.device_get(_dispatch_fn(mesh, topo, xla)(x, idx, w))
        for a, b in zip(got, want, strict=True):
            if b is not None:
                np.testing.assert_array_equal(np.asarray(a).view(np.uint8),
                                              np.asarray(b).view(np.uint8))  # fmt: skip
