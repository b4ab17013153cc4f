"""The ffi backend's CUDA lowering, checked on any machine (docs/design.md §5).

Lowers dispatch/combine and their VJPs for an abstract CUDA mesh (no GPU needed) and asserts on
the custom-call targets: with backend="ffi", a one-level EP group runs the CUDA handlers of
xla_ffi/cuda/handlers/ and nothing of the host's (whether its GPUs share a process or not); under
slower levels the transport spans the fastest level and the others go through XLA all-to-alls.
The routing reaches the slot-map kernel through an XLA all-gather over the fastest level, the
unpermute is a local call before the combine's exchange, and the routing-weight gradient returns
by an XLA all-to-all. "auto" keeps to the xla backend on GPUs until a GPU measures the CUDA
path faster (the `cuda` entry of routes.IMPLEMENTATIONS has auto_pick=False). The attributes
Python emits decode with the handlers' own decoders.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_hybridep as hep
from jax_hybridep import _native
from jax_hybridep.exchange import routes
from lab import native_module

pytestmark = pytest.mark.skipif(
    "gpu" not in _native.platforms(), reason="jax_hybridep was built without CUDA handlers"
)

T, H, K, E = 8, 64, 2, 8
CUDA_TARGETS = {
    "jax_hybridep_cuda_layout",  # the EP group's rows
    "jax_hybridep_cuda_slot_map",
    "jax_hybridep_cuda_dispatch",
    "jax_hybridep_cuda_unpermute",
    "jax_hybridep_cuda_combine",
    "jax_hybridep_cuda_redispatch_scaled",
}
# The calls that exchange over the level (the others are local).
EXCHANGES = {
    "jax_hybridep_cuda_dispatch",
    "jax_hybridep_cuda_combine",
    "jax_hybridep_cuda_redispatch_scaled",
}


def _gpu_topology(shape: dict[str, int], levels, local=None) -> hep.Topology:
    return hep.Topology(
        levels=tuple((lvl,) for lvl in levels),
        mesh_axes=tuple(shape),
        mesh_shape=tuple(shape.values()),
        platform="gpu",
        level_local=local or (True,) * len(levels),
    )


def _lowered(topo: hep.Topology, config: hep.DispatchConfig, weighted=True, grad=True, k=K) -> str:
    mesh = AbstractMesh(
        topo.mesh_shape, topo.mesh_axes, axis_types=(AxisType.Explicit,) * len(topo.mesh_axes)
    )
    spec = P(topo.mesh_axes)

    def layer(x, idx, w):
        d = hep.dispatch(x, idx, w, topology=topo, config=config)
        y = d.tokens * 2
        return hep.combine(y, d.handle, weights=d.weights if weighted else None)

    def loss(x, idx, w):
        out = jax.shard_map(layer, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)(x, idx, w)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    n = topo.ep_size * T
    sharding = NamedSharding(mesh, spec)
    args = (
        jax.ShapeDtypeStruct((n, H), jnp.bfloat16, sharding=sharding),
        jax.ShapeDtypeStruct((n, k), jnp.int32, sharding=sharding),
        jax.ShapeDtypeStruct((n, k), jnp.float32, sharding=sharding),
    )
    fn = jax.grad(loss, argnums=(0, 2)) if grad else loss
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _targets(text: str) -> set[str]:
    return set(re.findall(r"custom_call @(\w+)", text))


@pytest.mark.parametrize("weighted", [True, False])
def test_one_level_lowers_to_cuda_handlers(weighted):
    topo = _gpu_topology({"ep": 4}, ["ep"])
    text = _lowered(topo, hep.DispatchConfig(num_experts=E, backend="ffi", num_sms=8), weighted)
    targets = _targets(text)
    # Combine's VJP scales the rows in the same call when the combine was weighted.
    redispatch = "jax_hybridep_cuda_redispatch" + ("_scaled" if weighted else "")
    want = CUDA_TARGETS - {"jax_hybridep_cuda_redispatch_scaled"} | {redispatch}
    hybridep = {t for t in targets if t.startswith("jax_hybridep_")}
    assert hybridep == want
    assert "num_sms = 8" in text
    # The counts and the level's routing (dest, row, weight bits per (item, k): [4, T, K, 3]
    # int32) travel through XLA all-gathers (NCCL on GPUs), not a host rendezvous; the weight
    # gradient goes back by an all-to-all.
    assert re.search(rf"all_gather.*tensor<4x{T}x2x3xi32>", text)
    assert "all_to_all" in text


def test_auto_keeps_xla_on_gpus_until_verified(monkeypatch):
    topo = _gpu_topology({"ep": 8}, ["ep"])
    targets = _targets(_lowered(topo, hep.DispatchConfig(num_experts=E), grad=False))
    assert not any(t.startswith("jax_hybridep_") for t in targets)
    picked = tuple(dataclasses.replace(i, auto_pick=True) for i in routes.IMPLEMENTATIONS)
    monkeypatch.setattr(routes, "IMPLEMENTATIONS", picked)
    targets = _targets(_lowered(topo, hep.DispatchConfig(num_experts=E), grad=False))
    assert {
        "jax_hybridep_cuda_layout",
        "jax_hybridep_cuda_slot_map",
        "jax_hybridep_cuda_dispatch",
    } <= targets
    assert not any(t.startswith("jax_hybridep_") and "cuda" not in t for t in targets)


def test_two_level_gpu_topology_walks_slow_level_with_xla_collectives():
    """node x local: the node level's items travel by XLA all-to-all (NCCL), then the transport
    spans the 4 GPUs of a node; combine and the VJPs return the same way."""
    topo = _gpu_topology({"node": 2, "local": 4}, ["node", "local"])
    text = _lowered(topo, hep.DispatchConfig(num_experts=E, backend="ffi"))
    assert {t for t in _targets(text) if t.startswith("jax_hybridep_")} == CUDA_TARGETS
    assert "all_to_all" in text
    assert set(re.findall(r"num_ranks = (\d+)", text)) == {"4", "8"}  # transport 4, layout 8
    # auto keeps xla on GPUs until a GPU measures the CUDA path faster (routes.IMPLEMENTATIONS)
    targets = _targets(_lowered(topo, hep.DispatchConfig(num_experts=E), grad=False))
    assert not any(t.startswith("jax_hybridep_") for t in targets)


@pytest.mark.parametrize("in_process", [True, False])
def test_one_level_group_across_processes_uses_ipc_windows(in_process):
    """One process per GPU: the same handlers, told to open the other processes' windows."""
    topo = _gpu_topology({"ep": 4}, ["ep"], local=(in_process,))
    text = _lowered(topo, hep.DispatchConfig(num_experts=E, backend="ffi"), grad=False)
    assert "jax_hybridep_cuda_dispatch" in _targets(text)
    flags = set(re.findall(r"multi_process = (true|false)", text))
    assert flags == {"false" if in_process else "true"}


@pytest.mark.parametrize("stream,annotation", [("collective", "collective"), (2, "2")])
def test_transport_on_configured_stream(stream, annotation):
    """gpu_stream runs every transport call through compute_on (XLA's stream annotation)."""
    topo = _gpu_topology({"ep": 4}, ["ep"])
    text = _lowered(topo, hep.DispatchConfig(num_experts=E, backend="ffi", gpu_stream=stream))
    pattern = r"custom_call @(jax_hybridep_cuda_\w+)\(.*_xla_stream_annotation = \"(\w+)\""
    calls = re.findall(pattern, text)
    # The exchanges run on the stream; the local layout, slot map and unpermute stay on XLA's.
    assert {name for name, _ in calls} == EXCHANGES
    assert {a for _, a in calls} == {annotation}


def test_gpu_stream_is_validated():
    with pytest.raises(ValueError, match="gpu_stream must be"):
        hep.DispatchConfig(num_experts=E, gpu_stream="fast")
    with pytest.raises(ValueError, match="gpu_stream must be"):
        hep.DispatchConfig(num_experts=E, gpu_stream=0)


def test_top_k_beyond_the_kernels_is_refused_at_trace_time():
    topo = _gpu_topology({"ep": 4}, ["ep"])
    with pytest.raises(ValueError, match="top-k <= 64"):
        _lowered(topo, hep.DispatchConfig(num_experts=128, backend="ffi"), grad=False, k=65)


def _dispatch_call(text: str) -> str:
    (line,) = [ln for ln in text.splitlines() if "custom_call @jax_hybridep_cuda_dispatch(" in ln]
    return line


def test_zero_padding_off_leaves_rows_past_the_groups():
    topo = _gpu_topology({"ep": 4}, ["ep"])
    on = _lowered(
        topo, hep.DispatchConfig(num_experts=E, backend="ffi", pad_multiple=4), grad=False
    )
    off = _lowered(
        topo,
        hep.DispatchConfig(num_experts=E, backend="ffi", pad_multiple=4, zero_padding=False),
        grad=False,
    )
    assert "sparse_pad_multiple = 0" in on and "sparse_pad_multiple = 4" in off


@pytest.mark.parametrize("levels", [1, 2])
def test_fp8_dispatch_quantises_in_the_send_kernel_on_one_level(levels):
    """wire_dtype=float8_e4m3fn: on one level the transport gets the bf16 tokens and quantises
    them in its send kernel (no FP8 convert in XLA); under a slower level XLA quantises once at
    the source and the transport forwards the uint8 wire rows. Both deliver bf16 rows."""
    shape = {"ep": 4} if levels == 1 else {"node": 2, "local": 4}
    topo = _gpu_topology(shape, list(shape))
    cfg = hep.DispatchConfig(num_experts=E, backend="ffi", wire_dtype="float8_e4m3fn")
    text = _lowered(topo, cfg)
    call = _dispatch_call(text)
    assert f"fp8_hidden = {H}" in call
    operands, results = call.rsplit(": (", 1)[1].split(") -> ")
    x_type = operands.split(",")[0]
    assert x_type == (f"tensor<{T}x{H}xbf16>" if levels == 1 else x_type.split("x")[0] + "x68xui8>")
    assert f"x{H}xbf16>" in results.split(",")[0]  # dequantised by the permute
    assert ("f8E4M3FN" in text) == (levels > 1)
    # 16-bit dispatch leaves the attribute 0.
    plain = _dispatch_call(_lowered(topo, hep.DispatchConfig(num_experts=E, backend="ffi")))
    assert "fp8_hidden = 0" in plain


# Each CUDA target's attribute struct (xla_ffi/cuda/handlers/attrs.h; the layout takes the host's
# LayoutAttrsView, as layout_gathered does; the slot map none) and the test module's CPU probe
# decoding it with the same decoder.
PROBES = {
    "jax_hybridep_cuda_layout": "layout",
    "jax_hybridep_cuda_dispatch": "dispatch",
    "jax_hybridep_cuda_redispatch": "rows",
    "jax_hybridep_cuda_redispatch_scaled": "rows",
    "jax_hybridep_cuda_unpermute": "unpermute",
    "jax_hybridep_cuda_combine": "transport",
}
_TRANSPORT = ("site", "num_ranks", "timeout_ms", "num_sms", "multi_process")
_MEMBERS = {
    "transport": _TRANSPORT,
    "rows": _TRANSPORT + ("sparse_pad_multiple",),
    "dispatch": _TRANSPORT + ("sparse_pad_multiple", "fp8_hidden"),
    "unpermute": ("weighted",),
    "layout": (
        "num_ranks",
        "num_slots",
        "capacity",
        "rows",
        "pad_multiple",
        "strict",
        "expert_rank",
        "expert_slot",
    ),
}


def _cuda_call_attrs(monkeypatch, topo, config, weighted) -> list[tuple[str, dict]]:
    """(target, attributes) of every CUDA custom call the Python side emits for a layer + grads."""
    calls, real = [], jax.ffi.ffi_call

    def recording(target, *args, **kwargs):
        issue = real(target, *args, **kwargs)

        def call(*operands, **attrs):
            if target in PROBES:
                calls.append((target, attrs))
            return issue(*operands, **attrs)

        return call

    monkeypatch.setattr(jax.ffi, "ffi_call", recording)
    _lowered(topo, config, weighted)
    monkeypatch.undo()
    return calls


def test_attribute_bundles_decode_into_the_handlers_structs(monkeypatch):
    """The attributes Python builds for each CUDA call, decoded on CPU by the CUDA handlers' own
    struct decoders (a member missing, extra, renamed or of another type fails here, not first on
    a GPU), come back with the values Python sent."""
    native_module.testing_module()  # registers the probes
    one_level = _gpu_topology({"ep": 4}, ["ep"])
    across = _gpu_topology({"ep": 4}, ["ep"], local=(False,))
    calls = _cuda_call_attrs(
        monkeypatch, one_level, hep.DispatchConfig(num_experts=E, backend="ffi", num_sms=8), True
    )
    calls += _cuda_call_attrs(
        monkeypatch,
        across,
        hep.DispatchConfig(
            num_experts=E,
            backend="ffi",
            wire_dtype="float8_e4m3fn",
            capacity_factor=1.25,
            strict=True,
        ),
        False,
    )
    assert {target for target, _ in calls} == set(PROBES)

    def expected(target, attrs):
        values = []
        for member in _MEMBERS[PROBES[target]]:
            values.extend(np.atleast_1d(np.asarray(attrs[member])).astype(np.int64).tolist())
        return values

    def probe_all():
        return [
            jax.ffi.ffi_call(
                f"jax_hybridep_testing_decode_{PROBES[target]}",
                jax.ShapeDtypeStruct((len(expected(target, attrs)),), jnp.int32),
            )(**attrs)
            for target, attrs in calls
        ]

    with jax.default_device(jax.devices("cpu")[0]):
        decoded = jax.jit(probe_all)()  # one program for every call
    for (target, attrs), got in zip(calls, decoded, strict=True):
        assert np.asarray(got).tolist() == expected(target, attrs), (target, attrs)
    multi = {bool(attrs["multi_process"]) for t, attrs in calls if "multi_process" in attrs}
    assert multi == {True, False}
