"""Backend selection: which layout, level steps and bottom each backend and topology runs
(jax_hybridep/exchange/routes.py), and that a Topology built by its constructor runs everywhere.
(The contract suite, tests/contract_test.py, runs every case on every route kind.)"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from harness import make_mesh, moe_fn, random_routing
from route_kinds import ROUTES, same_bits_on

import jax_hybridep as hep
from jax_hybridep import _native
from jax_hybridep.config import make_plan
from jax_hybridep.exchange import (
    cuda,
    host_fused,
    host_steps,
    layout_steps,
    ragged_steps,
    routes,
    xla_steps,
)


def _topology(levels, local, single_process=True, platform="cpu") -> hep.Topology:
    names = tuple(f"a{i}" for i in range(len(levels)))
    return hep.Topology(
        levels=tuple((n,) for n in names),
        mesh_axes=names,
        mesh_shape=levels,
        single_process=single_process,
        platform=platform,
        level_local=local,
    )


def _kinds(route):
    return type(route.layout), tuple(type(s) for s in route.levels), type(route.bottom)


@pytest.mark.parametrize(
    "levels,local,single,want",
    [
        ((8,), (True,), True, (layout_steps.HostLayout, (), host_fused.HostFused)),
        (
            (2, 4),
            (True, True),
            True,
            (
                layout_steps.HostLayout,
                (host_steps.HostDirectLevel, host_steps.HostDirectLevel),
                host_steps.HostRows,
            ),
        ),
        (
            (2, 4),
            (False, True),
            False,
            (
                layout_steps.HostGatheredLayout,
                (host_steps.HostPackedLevel, host_steps.HostDirectLevel),
                host_steps.HostRows,
            ),
        ),
        (
            (8,),
            (False,),
            False,
            (layout_steps.HostGatheredLayout, (host_steps.HostPackedLevel,), host_steps.HostRows),
        ),
    ],
)
def test_ffi_routes_on_cpu(levels, local, single, want):
    assert _kinds(routes.route_for("ffi", _topology(levels, local, single))) == want


def test_xla_route_walks_every_level_and_gpu_route_spans_the_fastest():
    topo = _topology((2, 2, 2), (True,) * 3)
    xla = routes.route_for("xla", topo)
    assert _kinds(xla) == (layout_steps.JnpLayout, (xla_steps.XlaLevel,) * 3, xla_steps.XlaRows)
    gpu = routes.route_for("ffi", dataclasses.replace(topo, platform="gpu"))
    assert _kinds(gpu) == (
        layout_steps.CudaLayout,
        (ragged_steps.RaggedLevel,) * 2,
        cuda.CudaBottom,
    )
    gpu.check(topo)
    xla.check(topo)


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_xla_backend_sends_real_items_where_xla_compiles_ragged_all_to_all(platform):
    """On GPUs and TPUs the xla backend's levels are ragged (`xla_ragged`), `auto` picks it
    where the ffi backend cannot or may not run, and on CPU the padded `xla` route stays."""
    topo = dataclasses.replace(_topology((2, 4), (True, True)), platform=platform)
    ragged = routes.route_for("xla", topo)
    assert ragged.name == "xla_ragged" and ragged.backend == "xla"
    assert _kinds(ragged) == (
        layout_steps.JnpLayout,
        (ragged_steps.RaggedLevel,) * 2,
        xla_steps.XlaRows,
    )
    ragged.check(topo)
    plan = make_plan(topo, hep.DispatchConfig(num_experts=16), tokens=8, k=2)
    for backend in ("xla", "auto"):
        cfg = hep.DispatchConfig(num_experts=16, backend=backend)
        assert routes.select(cfg, topo, frozenset(topo.mesh_axes), plan) == ragged
    cpu = routes.route_for("xla", dataclasses.replace(topo, platform="cpu"))
    assert cpu.name == "xla" and _kinds(cpu)[1] == (xla_steps.XlaLevel,) * 2


def test_route_must_cover_the_topology():
    route = routes.route_for("ffi", _topology((2, 4), (True, True)))
    with pytest.raises(ValueError, match=r"route walks 2 level\(s\) and its bottom spans 0"):
        route.check(_topology((8,), (True,)))


def test_routes_are_static_and_hashable():
    topo = _topology((2, 4), (True, True))
    assert routes.route_for("ffi", topo) == routes.route_for("ffi", topo)
    assert hash(routes.route_for("xla", topo)) == hash(routes.route_for("xla", topo))


def test_constructed_topology_defaults_level_local():
    topo = _topology((2, 4), None)
    assert topo.level_local == (True, True)
    assert _topology((8,), None, single_process=False).level_local == (False,)
    with pytest.raises(ValueError, match="level_local"):
        _topology((2, 4), (True,))


@pytest.mark.skipif(not _native.available(), reason="native module not built")
def test_constructed_topology_runs_ffi_like_xla():
    """A Topology from its constructor (no level_local given) runs the ffi route, bitwise xla."""
    mesh = make_mesh((2, 4), ("node", "local"))
    topo = hep.Topology(
        levels=(("node",), ("local",)), mesh_axes=("node", "local"), mesh_shape=(2, 4)
    )
    rng = np.random.default_rng(3)
    idx, w = random_routing(rng, 8 * 6, 2, 16, invalid_fraction=0.1)
    x = rng.standard_normal((8 * 6, 8)).astype(np.float32)
    experts = rng.standard_normal((16, 8, 8)).astype(np.float32)

    def program(kind):
        seen, cfg, route = ROUTES[kind].prepare(topo, hep.DispatchConfig(num_experts=16))
        return moe_fn(mesh, seen, cfg, route=route)

    same_bits_on(("ffi",), program, x, idx, w, experts)


def test_cuda_bottom_refuses_fp8_too_wide_only_where_the_send_quantises():
    """The CUDA bottom asks its route's wire form whether the send kernel quantises the tokens:
    over one GPU level it does (and 24576 bf16 values do not fit beside 62 GPUs' maps); below a
    slower level, or given already quantised, XLA or the caller quantised them and the send only
    copies bytes."""
    from jax_hybridep.config import make_plan

    cfg = hep.DispatchConfig(num_experts=124, wire_dtype="float8_e4m3fn")
    reasons = {}
    for name, levels, row_dtype in [
        ("one level", (62,), "bfloat16"),
        ("two levels", (2, 62), "bfloat16"),
        ("quantised x", (62,), "float8_e4m3fn"),
    ]:
        topo = _topology(levels, None, platform="gpu")
        plan = make_plan(topo, cfg, 8, 2, hidden=24576, row_dtype=row_dtype)
        route = routes.route_for("ffi", topo)
        reasons[name] = route.bottom.unsupported_reason(plan, route.wire_form(plan))
    assert "quantises each token whole" in reasons.pop("one level")
    assert reasons == {"two levels": None, "quantised x": None}
