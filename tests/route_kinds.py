"""The route kinds every contract case runs on (tests/contract_test.py): one registry entry each.

A `RouteKind` says how one dispatch runs on a mesh: the backend its config asks for, how it sees
the topology (e.g. as a multi-process run does), and an explicit exchange route where this machine
lacks the real one. On CPU that gives every step kind of jax_hybridep/exchange/routes.py:

| kind         | layout             | levels walked                         | bottom              |
|--------------|--------------------|---------------------------------------|---------------------|
| `xla`        | JnpLayout          | XlaLevel x L                          | XlaRows             |
| `xla_ragged` | JnpLayout          | RaggedLevel x L (stand-in exchange)   | XlaRows             |
| `ffi`        | HostLayout         | none (1 level) / HostDirectLevel x L  | HostFused / HostRows|
| `ffi_packed` | HostGatheredLayout | HostPackedLevel x L, or x (L - 1) and | HostRows            |
|              |                    | HostDirectLevel on the fastest        |                     |
| `gpu_twin`   | JnpLayout          | RaggedLevel x (L - 1) (stand-in)      | CudaBottom (twin)   |

`ffi_packed` is the host route as a run with one process per node sees it (every level but the
fastest crosses processes; a single level does): the packed levels exchange through XLA
all-to-alls, so it runs in this one process. `xla_ragged` is the `xla` route as GPUs and TPUs
build it, its ragged exchanges issued by the pure-JAX stand-in of `jax.lax.ragged_all_to_all`
(tests/ragged_standin.py; XLA:CPU cannot compile the op). `gpu_twin` is the GPU route with the
CUDA bottom's exchanges issued by their pure-JAX twin (tests/transport_twin.py) and the jnp
layout: everything else runs as on GPUs (slow levels by ragged exchanges, through the same
stand-in; the bottom spanning the fastest level, the record, combine and both VJPs); the kernels
themselves are held to the same §2.1 model on a GPU (tests/cuda_transport_test.py) and on the
CPU under the host executor (tests/host_executor_transport_test.py). The twin keeps the CPU
topology, so its routing-weight gradient takes the CPU's fixed summation order, as the
reference does (on GPUs both backends take XLA's reduction there: jax_hybridep/weight_grad.py).
A new level kind or bottom is one more entry here.

The reference (`xla`) is checked against the numpy model of §2.1; every other kind must give its
bits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import PartitionSpec as P
from ragged_standin import ragged_all_to_all
from transport_twin import JaxExchanges

import jax_hybridep as hep
from jax_hybridep.exchange import cuda, layout_steps, ragged_steps, routes
from jax_hybridep.ops import dispatch_with_route


def _as_is(topo: hep.Topology) -> hep.Topology:
    return topo


def _across_processes(topo: hep.Topology) -> hep.Topology:
    """As one process per node sees it: every level but the fastest crosses processes."""
    local = (False,) * (len(topo.levels) - 1) + (len(topo.levels) > 1,)
    return dataclasses.replace(topo, single_process=False, level_local=local)


def _standin_levels(route: routes.Route) -> routes.Route:
    """The route with its ragged levels' exchange issued by the CPU stand-in."""
    levels = tuple(
        dataclasses.replace(step, exchange=ragged_all_to_all)
        if isinstance(step, ragged_steps.RaggedLevel)
        else step
        for step in route.levels
    )
    return dataclasses.replace(route, levels=levels)


def ragged_route(topo: hep.Topology) -> routes.Route:
    """The `xla` backend's route on GPUs and TPUs (ragged levels), through the stand-in."""
    route = routes.route_for("xla", dataclasses.replace(topo, platform="gpu"))
    assert all(isinstance(step, ragged_steps.RaggedLevel) for step in route.levels)
    return _standin_levels(route)


def gpu_twin_route(topo: hep.Topology, exchanges=None) -> routes.Route:
    """The GPU route, its CUDA bottom's custom calls (`exchanges`, default the pure-JAX twin),
    layout and slower levels' ragged exchanges swapped for pure-JAX ones."""
    gpu = routes.route_for("ffi", dataclasses.replace(topo, platform="gpu"))
    assert isinstance(gpu.bottom, cuda.CudaBottom)
    twin = cuda.CudaBottom(exchanges=exchanges or JaxExchanges())
    gpu = _standin_levels(gpu)
    return dataclasses.replace(gpu, layout=layout_steps.JnpLayout(), bottom=twin)


@dataclasses.dataclass(frozen=True)
class RouteKind:
    """One way a dispatch runs (see the module docstring).

    Attributes:
      name: the registry key (a test id).
      backend: the `DispatchConfig.backend` it runs with.
      sees: the topology this kind runs on, from the mesh's.
      explicit: the exchange route to force, from the topology it sees (None: the backend's).
      config: further `DispatchConfig` fields it runs with, as (name, value) pairs.
      reference: the kind whose bits this one must give; None: checked against the model.
    """

    name: str
    backend: str
    sees: Callable[[hep.Topology], hep.Topology] = _as_is
    explicit: Callable[[hep.Topology], routes.Route] | None = None
    config: tuple = ()
    reference: str | None = "xla"

    def prepare(self, topo: hep.Topology, config: hep.DispatchConfig):
        """(topology, config, route or None) this kind dispatches with on `topo`."""
        seen = self.sees(topo)
        route = self.explicit(seen) if self.explicit is not None else None
        return seen, dataclasses.replace(config, backend=self.backend, **dict(self.config)), route

    def route(self, topo: hep.Topology) -> routes.Route:
        """The steps this kind runs on `topo` (what the registry table says)."""
        seen = self.sees(topo)
        return self.explicit(seen) if self.explicit else routes.route_for(self.backend, seen)

    def dispatch(self, x, topk_idx, topk_weights, *, topology, config) -> hep.Dispatched:
        """`hep.dispatch` along this kind's route (inside shard_map, like `hep.dispatch`)."""
        topology, config, route = self.prepare(topology, config)
        return dispatch_with_route(
            route, x, topk_idx, topk_weights, topology=topology, config=config
        )


ROUTES = {
    kind.name: kind
    for kind in (
        RouteKind("xla", "xla", reference=None),
        RouteKind("ffi", "ffi"),
        RouteKind("ffi_packed", "ffi", sees=_across_processes),
        RouteKind("xla_ragged", "xla", explicit=ragged_route),
        RouteKind("gpu_twin", "ffi", explicit=gpu_twin_route),
    )
}


def on_mesh(mesh, fn, in_specs=None, out_specs=None, num_args=3):
    """jit(shard_map(fn)) over every mesh axis; specs default to P(all axes) for each of
    `num_args` inputs and for the output."""
    spec = P(tuple(mesh.axis_names))
    in_specs = (spec,) * num_args if in_specs is None else in_specs
    return jax.jit(
        jax.shard_map(
            fn, mesh=mesh, in_specs=in_specs, out_specs=spec if out_specs is None else out_specs
        )
    )


def bits(a) -> np.ndarray:
    """An array's bits: floats viewed as unsigned ints of their width (NaN and -0 compare)."""
    a = np.asarray(a)
    if a.dtype.kind in "biu":
        return a
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def same_bits_on(kinds, build, *args):
    """Runs `build(kind)` (a jitted program) on `args` for each of `kinds` and its reference,
    asserts every output leaf has the reference's bits, and returns the outputs per kind."""
    out = {}
    for kind in kinds:
        for name in (ROUTES[kind].reference, kind):
            if name not in out:
                out[name] = jax.device_get(build(name)(*args))
        pairs = zip(
            jax.tree_util.tree_leaves_with_path(out[kind]),
            jax.tree.leaves(out[ROUTES[kind].reference]),
            strict=True,
        )
        for (path, a), b in pairs:
            np.testing.assert_array_equal(
                bits(a), bits(b), err_msg=f"{kind}{jax.tree_util.keystr(path)}"
            )
    return out


def combine_vjp(mesh, topo, config, loss):
    """`build` for `same_bits_on`: per kind, the jitted gradients (y, row weights) of
    `loss(hep.combine(y, handle, weights=row_weights), x)` after a dispatch of (x, idx, w)."""

    def build(kind):
        def step(x, idx, w, y, row_weights):
            d = ROUTES[kind].dispatch(x, idx, w, topology=topo, config=config)

            def of(y, row_weights):
                return loss(hep.combine(y, d.handle, weights=row_weights), x)

            return jax.grad(of, (0, 1))(y, row_weights)

        return on_mesh(mesh, step, num_args=5)

    return build
