"""The ffi backend's CUDA lowering over transport v2, checked on any machine (docs/design.md §5).

As tests/cuda_lowering_test.py does for transport v1: dispatch/combine and their VJPs lowered for
an abstract CUDA mesh with `DispatchConfig(gpu_transport="v2")`, asserting on the custom calls.
The routing reaches the layout kernel through an XLA all-gather over the fastest level, the
unpermute is a local call before the combine's exchange, the routing-weight gradient returns by
an XLA all-to-all, and v1's transport calls are gone; v1 stays the default.
"""

from __future__ import annotations

import re

import pytest
from cuda_lowering_test import CUDA_TARGETS, E, H, T, _dispatch_call, _gpu_topology, _lowered

import jax_hybridep as hep
from jax_hybridep import _native

pytestmark = pytest.mark.skipif(
    "gpu" not in _native.platforms(), reason="jax_hybridep was built without CUDA handlers"
)

V2_TARGETS = {
    "jax_hybridep_cuda_layout",  # the EP group's rows (shared with v1)
    "jax_hybridep_cuda_v2_layout",
    "jax_hybridep_cuda_v2_dispatch",
    "jax_hybridep_cuda_v2_unpermute",
    "jax_hybridep_cuda_v2_combine",
    "jax_hybridep_cuda_v2_redispatch_scaled",
}


def _hybridep_targets(text: str) -> set[str]:
    return {t for t in re.findall(r"custom_call @(\w+)", text) if t.startswith("jax_hybridep_")}


def _v2(**kw) -> hep.DispatchConfig:
    return hep.DispatchConfig(num_experts=E, backend="ffi", gpu_transport="v2", **kw)


@pytest.mark.parametrize("weighted", [True, False])
def test_one_level_lowers_to_v2_handlers(weighted):
    topo = _gpu_topology({"ep": 4}, ["ep"])
    text = _lowered(topo, _v2(num_sms=8), weighted)
    redispatch = "jax_hybridep_cuda_v2_redispatch" + ("_scaled" if weighted else "")
    want = V2_TARGETS - {"jax_hybridep_cuda_v2_redispatch_scaled"} | {redispatch}
    assert _hybridep_targets(text) == want
    assert "num_sms = 8" in text
    # The routing of the level (dest, row, weight bits per (item, k)) is all-gathered for the
    # layout kernel: [4, T, K, 3] int32; the weight gradient goes back by an all-to-all.
    assert re.search(rf"all_gather.*tensor<4x{T}x2x3xi32>", text)
    assert "all_to_all" in text
    # v1 stays the default.
    v1 = _hybridep_targets(_lowered(topo, hep.DispatchConfig(num_experts=E, backend="ffi")))
    assert v1 == CUDA_TARGETS and not any("_v2_" in t for t in v1)


def test_two_level_gpu_topology_walks_slow_level_with_xla_collectives():
    topo = _gpu_topology({"node": 2, "local": 4}, ["node", "local"])
    text = _lowered(topo, _v2())
    assert _hybridep_targets(text) == V2_TARGETS
    assert set(re.findall(r"num_ranks = (\d+)", text)) == {"4", "8"}  # transport 4, layout 8


@pytest.mark.parametrize("in_process", [True, False])
def test_group_across_processes_uses_ipc_windows(in_process):
    topo = _gpu_topology({"ep": 4}, ["ep"], local=(in_process,))
    text = _lowered(topo, _v2(), grad=False)
    assert set(re.findall(r"multi_process = (true|false)", text)) == {
        "false" if in_process else "true"
    }


def test_v2_exchanges_on_the_configured_stream():
    topo = _gpu_topology({"ep": 4}, ["ep"])
    text = _lowered(topo, _v2(gpu_stream="collective"))
    pattern = r"custom_call @(jax_hybridep_cuda_v2_\w+)\(.*_xla_stream_annotation = \"(\w+)\""
    calls = dict(re.findall(pattern, text))
    # The exchanges run on the stream; the local layout and unpermute stay on XLA's.
    assert set(calls) == {"jax_hybridep_cuda_v2_dispatch", "jax_hybridep_cuda_v2_combine",
                          "jax_hybridep_cuda_v2_redispatch_scaled"}  # fmt: skip
    assert set(calls.values()) == {"collective"}


def test_zero_padding_off_leaves_rows_past_the_groups():
    topo = _gpu_topology({"ep": 4}, ["ep"])
    on = _lowered(topo, _v2(pad_multiple=4), grad=False)
    off = _lowered(topo, _v2(pad_multiple=4, zero_padding=False), grad=False)
    assert "sparse_pad_multiple = 0" in on and "sparse_pad_multiple = 4" in off


@pytest.mark.parametrize("levels", [1, 2])
def test_fp8_dispatch_quantises_in_the_v2_send_on_one_level(levels):
    shape = {"ep": 4} if levels == 1 else {"node": 2, "local": 4}
    topo = _gpu_topology(shape, list(shape))
    text = _lowered(topo, _v2(wire_dtype="float8_e4m3fn"))
    (call,) = [
        ln for ln in text.splitlines() if "custom_call @jax_hybridep_cuda_v2_dispatch(" in ln
    ]
    assert f"fp8_hidden = {H}" in call
    x_type = call.rsplit(": (", 1)[1].split(") -> ")[0].split(",")[0]
    assert x_type == (f"tensor<{T}x{H}xbf16>" if levels == 1 else x_type.split("x")[0] + "x68xui8>")
    assert ("f8E4M3FN" in text) == (levels > 1)
    v1 = _lowered(topo, hep.DispatchConfig(num_experts=E, backend="ffi"))
    assert "fp8_hidden = 0" in _dispatch_call(v1)
