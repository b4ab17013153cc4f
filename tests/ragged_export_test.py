"""The ragged levels as GPUs and TPUs compile them, checked on this CPU machine (docs/design.md §5).

`jax.export` lowers dispatch -> combine and its gradients for abstract `cuda` and `tpu` meshes (no
accelerator needed; the serialisation check refuses `ragged_all_to_all`, which has no
compatibility guarantee, until it is disabled). The StableHLO must hold, per walked level, one
`ragged_all_to_all` per direction that crosses it, with the operand shapes
jax_hybridep/exchange/ragged_steps.py states (send [M * min(S, K), W], receive
[min(S * M, C * below), W]; W the wire row's words), the counts' one all-gather per level, and no
all_to_all of rows. What is counted, per level, in a weighted combine's value and gradients with
respect to x and the routing weights:

* dispatch: one exchange of wire rows (payload, scales, destination, row, weight per k);
* combine (the forward's partials) and dispatch's VJP (a combine of the row cotangents): one
  exchange of [B, H] partials back each;
* combine's VJP: one exchange forward of the output cotangent, [Q, H] -> [B, H];
* the routing-weight gradient: one exchange back of [B, K] float32 values.

The CUDA route (backend="ffi") is lowered for `cuda` rather than exported (its own handlers'
targets carry no compatibility guarantee either); its slower level is held to the same count.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_hybridep as hep
from jax_hybridep import _native, fp8

T, H, K = 8, 64, 2
RAGGED = re.compile(
    r"custom_call @ragged_all_to_all\([^)]*\) \{.*?replica_groups = dense<.*?> : "
    r"tensor<(\d+)x(\d+)xi64>\}\} : \(([^)]*)\) -> "
)
TENSOR = re.compile(r"tensor<([\dx]+)x(\w+)>")


def _topology(shape: dict[str, int], platform: str) -> hep.Topology:
    return hep.Topology(
        levels=tuple((a,) for a in shape),
        mesh_axes=tuple(shape),
        mesh_shape=tuple(shape.values()),
        platform=platform,
    )


def _exported(topo, config, platform, grad=True) -> str:
    mesh = AbstractMesh(
        topo.mesh_shape, topo.mesh_axes, axis_types=(AxisType.Explicit,) * len(topo.mesh_axes)
    )
    spec = P(topo.mesh_axes)

    def layer(x, idx, w):
        d = hep.dispatch(x, idx, w, topology=topo, config=config)
        return hep.combine(d.tokens * 2, d.handle, weights=d.weights)

    def loss(x, idx, w):
        out = jax.shard_map(layer, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)(x, idx, w)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    n = topo.ep_size * T
    sharding = NamedSharding(mesh, spec)
    args = (
        jax.ShapeDtypeStruct((n, H), jnp.bfloat16, sharding=sharding),
        jax.ShapeDtypeStruct((n, K), jnp.int32, sharding=sharding),
        jax.ShapeDtypeStruct((n, K), jnp.float32, sharding=sharding),
    )
    fn = jax.grad(loss, argnums=(0, 2)) if grad else loss
    if config.backend == "ffi":  # the CUDA handlers' own targets: lowered, not exported
        return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    checks = [jax.export.DisabledSafetyCheck.custom_call("ragged_all_to_all")]
    export = jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)
    return export(*args).mlir_module()


def _ragged(text: str) -> list[tuple[int, list[tuple[tuple[int, ...], str]]]]:
    """Each ragged_all_to_all: (its group size, [(shape, element type) of each operand])."""
    out = []
    for _, group, operands in RAGGED.findall(text):
        arrays = [
            (tuple(int(d) for d in dims.split("x")), kind)
            for dims, kind in TENSOR.findall(operands)
        ]
        out.append((int(group), arrays))
    return out


def _slots(topo, rows: int):
    """Per level (S, Q, B) as the design states them: Q = M * min(S, K) send slots and
    B = min(S * M, C * below) receive slots, M_0 = T and M_{l+1} = B_l."""
    out, held = [], T
    for level, size in enumerate(topo.level_sizes):
        below = math.prod(topo.level_sizes[level + 1 :])
        send, recv = held * min(size, K), min(size * held, rows * below)
        out.append((size, send, recv))
        held = recv
    return out


CASES = {
    # name: (mesh, config fields, C)
    "flat8_dropless": ({"ep": 8}, {}, T * 8 * min(K, 2)),
    "flat8_capacity": ({"ep": 8}, {"capacity_factor": 1.0}, 2 * math.ceil(T * 8 * K / 16)),
    "node2_local4_dropless": ({"node": 2, "local": 4}, {}, T * 8 * min(K, 2)),
    "node2_local4_budget": ({"node": 2, "local": 4}, {"row_budget": 12}, 12),
}


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_one_ragged_exchange_per_level_per_direction(platform, case):
    shape, fields, rows = CASES[case]
    topo = _topology(shape, "gpu" if platform == "cuda" else "tpu")
    for backend in ("xla", "auto"):
        cfg = hep.DispatchConfig(num_experts=16, backend=backend, **fields)
        text = _exported(topo, cfg, platform)
        ragged = _ragged(text)
        words = H + 3 * K * 2  # bf16 payload, then dest, row, weight per k as uint16 pairs
        for size, send, recv in _slots(topo, rows):
            mine = sorted(
                (tuple(dims for dims, _ in arrays[:2]), arrays[0][1])
                for group, arrays in ragged
                if group == size
            )
            assert mine == sorted(
                [
                    (((send, words), (recv, words)), "ui16"),  # dispatch
                    (((recv, H), (send, H)), "bf16"),  # combine
                    (((recv, H), (send, H)), "bf16"),  # dispatch's VJP
                    (((send, H), (recv, H)), "bf16"),  # combine's VJP
                    (((recv, K), (send, K)), "f32"),  # routing-weight gradient
                ]
            ), (size, mine)
            for _, arrays in (r for r in ragged if r[0] == size):
                assert arrays[2:] == [((size,), "i32")] * 4  # offsets and sizes
        assert len(ragged) == 5 * len(topo.levels)
        # The counts' all-gather per level ([S] int32 -> [S, S]) beside the layout's, and no
        # all_to_all (no padded exchange left).
        assert "all_to_all" not in text.replace("ragged_all_to_all", "")
        gathers = re.findall(r"all_gather.*?-> tensor<([\dx]+)xi32>", text)
        for size in topo.level_sizes:
            assert f"{size}x{size}" in gathers, gathers


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_fp8_on_the_wire_sends_wire_rows_of_bytes(platform):
    """FP8 on the wire: the payload's bytes, its block scales, then the metadata, as uint8."""
    topo = _topology({"ep": 8}, "gpu" if platform == "cuda" else "tpu")
    cfg = hep.DispatchConfig(num_experts=16, backend="xla", wire_dtype="float8_e4m3fn")
    ragged = _ragged(_exported(topo, cfg, platform, grad=False))
    ((_, send, recv),) = _slots(topo, T * 8 * 2)
    width = fp8.wire_bytes(H) + 12 * K
    assert [arrays[:2] for _, arrays in ragged][0] == [
        ((send, width), "ui8"),
        ((recv, width), "ui8"),
    ]
    assert len(ragged) == 2  # dispatch and combine


@pytest.mark.skipif(
    "gpu" not in _native.platforms(), reason="jax_hybridep was built without CUDA handlers"
)
def test_cuda_route_slower_levels_are_ragged():
    """backend="ffi" on node x local GPUs: the node level by ragged exchanges (the transport spans
    the GPUs of a node); the only all_to_all left is the transport's routing-weight return."""
    topo = _topology({"node": 2, "local": 4}, "gpu")
    cfg = hep.DispatchConfig(num_experts=16, backend="ffi")
    text = _exported(topo, cfg, "cuda")
    assert "jax_hybridep_cuda_dispatch" in text
    ragged = _ragged(text)
    assert {group for group, _ in ragged} == {2} and len(ragged) == 5
    (size, send, recv), _ = _slots(topo, T * 8 * 2)
    assert ragged[0][1][:2] == [((send, H + 3 * K * 2), "ui16"), ((recv, H + 3 * K * 2), "ui16")]
    for line in re.findall(r"\"?stablehlo.all_to_all\"?.*", text):
        assert re.search(rf"tensor<[\dx]+x{K}xf32>", line) and '"local"' in line, line


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_jacobians_lower_with_the_batch_as_wider_rows(platform):
    """`jax.jacrev` (VJPs mapped over cotangents) exports: each backward exchange carries the
    batch of n * H cotangents as rows n * H times wider, with the dispatch's offsets (jax 0.12's
    own batching rule of ragged_all_to_all would assert on offsets that are not batched)."""
    topo = _topology({"ep": 4}, "gpu" if platform == "cuda" else "tpu")
    mesh = AbstractMesh((4,), ("ep",), axis_types=(AxisType.Explicit,))
    cfg = hep.DispatchConfig(num_experts=8, backend="xla")
    h, n = 4, 4 * T

    def layer(x, idx, w):
        d = hep.dispatch(x, idx, w, topology=topo, config=cfg)
        return hep.combine(d.tokens * 2, d.handle, weights=d.weights)

    def f(x, idx, w):
        return jax.shard_map(layer, mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep"))(
            x, idx, w
        )

    sharding = NamedSharding(mesh, P("ep"))
    args = (
        jax.ShapeDtypeStruct((n, h), jnp.float32, sharding=sharding),
        jax.ShapeDtypeStruct((n, K), jnp.int32, sharding=sharding),
        jax.ShapeDtypeStruct((n, K), jnp.float32, sharding=sharding),
    )
    checks = [jax.export.DisabledSafetyCheck.custom_call("ragged_all_to_all")]
    jac = jax.jit(jax.jacrev(f, argnums=(0, 2)))
    text = jax.export.export(jac, platforms=[platform], disabled_checks=checks)(*args)
    ragged = _ragged(text.mlir_module())
    batch = n * h  # one cotangent per output element
    widths = sorted(arrays[0][0][1] for _, arrays in ragged)
    assert widths == sorted([h + 3 * K, batch * h, batch * h, batch * K]), widths
