"""Reading collectives out of compiled HLO (`traffic`) and the one all-reduce convention shared by
`traffic.crossing_bytes`, `xdc.volumes` and `xdc.cost`.

A hand-written HLO fragment checks the parser where XLA's printing is awkward (tuples of six or
more arrays carry `/*index=5*/` annotations; combined collectives join their op_names with ":");
compiled SR-compressed gathers and their gradients (2 and 4 layers, domains of 2 and 4 DCs, each
shared-expert variant, gradient compression) check that what the program moves is what the model
counts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from harness import make_mesh
from jax.sharding import PartitionSpec as P

import jax_hybridep as hep
from jax_hybridep import traffic
from jax_hybridep.xdc.migration import Migration
from jax_hybridep.xdc.model import cost, volumes
from jax_hybridep.xdc.runtime import domains, migrate

GROUPS = "mesh['dc'=2,'local'=2]"
HLO = f"""
  %all-reduce.1 = (f32[4,2]{{1,0}}, f32[4,2]{{1,0}}, f32[8]{{0}}, f32[], f32[], /*index=5*/f32[3,2]{{1,0}}, s32[]) all-reduce(%a, %b, %c, %d, %e, /*index=5*/%f, %g), channel_id=1, replica_groups={GROUPS} {{'dc','local'}}, use_global_device_ids=true, to_apply=%add, metadata={{op_name="jit(f)/a:shard_map/b:c:d:e:shard_map/f:g" stack_frame_id=3}}
  %all-gather.2 = f32[2,8]{{1,0}} all-gather(%x), channel_id=2, replica_groups={GROUPS} {{'dc'}}, dimensions={{0}}, metadata={{op_name="jit(f)/shard_map/all_gather"}}
  %all-gather-start.3 = (f32[1,8]{{1,0}}, f32[2,8]{{1,0}}) all-gather-start(%y), channel_id=3, replica_groups={GROUPS} {{'local'}}, dimensions={{0}}
  %gte.4 = f32[4,2]{{1,0}} get-tuple-element(%all-reduce.1), index=0
"""  # noqa: E501


def test_collectives_read_long_tuples_and_per_array_op_names():
    found = traffic.collectives(HLO)
    assert [c.op for c in found] == ["all-reduce", "all-gather", "all-gather"]
    reduce = found[0]
    assert len(reduce.operands) == 7  # the sixth array's `/*index=5*/` does not end the tuple
    assert reduce.operands[5] == ("f32", (3, 2)) and reduce.operands[6] == ("s32", ())
    assert reduce.bytes == 32 + 32 + 32 + 4 + 4 + 24 + 4
    assert reduce.op_names[1] == "shard_map/b" and reduce.op_names[2] == "c"
    assert found[1].op_names == ("jit(f)/shard_map/all_gather",)  # one name, one array
    assert found[2].operands == (("f32", (2, 8)),)  # an async start keeps its results only
    assert traffic.collective_bytes(HLO, "all-reduce") == [
        ("f32", 132, f"{GROUPS} {{'dc','local'}}")
    ]
    assert traffic.collective_bytes(HLO, "all-reduce", op_name="shard_map")[0][1] == 32 + 24


def test_crossing_bytes_filters_per_array():
    # All-reduce over 4 ranks, 2 of them in the other DC: 2 * b * 2 / 4 = b of every array.
    every = traffic.crossing_bytes(HLO, "dc")
    assert every == {"all-to-all": 0, "all-gather": 32, "reduce-scatter": 0, "all-reduce": 132}
    assert traffic.crossing_bytes(HLO, "dc", op_name="shard_map")["all-reduce"] == 32 + 24
    assert traffic.crossing_bytes(HLO, "dc", dtype="s32")["all-reduce"] == 4
    params = traffic.crossing_bytes(HLO, "dc", operands=lambda kind, shape: len(shape) >= 1)
    assert params["all-reduce"] == 32 + 32 + 32 + 24
    assert traffic.crossing_bytes(HLO, "local")["all-gather"] == 64 // 2  # the async one
    assert traffic.crossing_bytes(HLO, (a for a in ["dc"])) == every  # a one-shot iterable
    with pytest.raises(ValueError, match="op must be one of"):
        traffic.collectives(HLO, "all-scatter")
    with pytest.raises(ValueError, match="unknown HLO element type 'q7'"):
        traffic.array_bytes("q7", (2,))


def test_all_reduce_convention():
    # Over one level's S members: 2 (S - 1) / S of the bytes, a ring's volume; at S = 4 one
    # expert of 8,192 B is 12,288 B.
    assert traffic.all_reduce_bytes(8192, 4, 3) == 12_288
    assert traffic.all_reduce_bytes(8192, 2, 1) == 8192
    assert traffic.all_reduce_bytes(800, 8, 4) == 800  # 8 ranks, 4 across a level of 2


def _compressed_step(mesh, topo, migration, layers):
    """HLO of the forward and backward of the SR-compressed gathers of `layers` layers' three
    expert matrices (E = 16), with the persistent reference and the error feedback as inputs
    where the migration keeps them, and the reference's refresh as a block runs it."""
    doms = domains.ExpertDomains.from_mesh(mesh, topo, migration)
    mig = doms.migration
    shapes = [(16, 8, 12), (16, 8, 12), (16, 12, 8)] * layers
    spec, every = P(doms.expert_axes), P(tuple(doms.mesh.axis_names))
    refs = [jnp.zeros(s[1:], jnp.float32) for s in shapes] if mig.persistent else []
    local = [(s[0] // topo.ep_size, *s[1:]) for s in shapes]
    feedback = [
        [jnp.zeros((mesh.devices.size * f[0], *f[1:]), jnp.float32) for f in axis]
        for axis in (doms.feedback_shapes(local) if mig.grad_compression else [])
    ]

    def body(weights, refs, feedback):
        gathered = doms.gather_experts(weights, refs, feedback)
        if mig.persistent:  # the refresh a block runs, once per layer
            for i in range(layers):
                w3, r3 = weights[3 * i : 3 * i + 3], refs[3 * i : 3 * i + 3]
                gathered += migrate.refresh(w3, r3, jnp.int32(0), 1, doms.expert_axes)
        return sum(jnp.sum(jnp.sin(w)) for w in gathered)[None]

    fb_specs = tuple((every,) * len(f) for f in feedback)
    fn = jax.shard_map(
        body,
        mesh=doms.mesh,
        in_specs=((spec,) * len(shapes), (P(),) * len(refs), fb_specs),
        out_specs=every,
    )

    def loss(weights, refs, feedback):
        return jnp.sum(fn(weights, refs, feedback))

    args = (
        tuple(jnp.ones(s, jnp.float32) for s in shapes),
        tuple(refs),
        tuple(tuple(f) for f in feedback),
    )
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 2))).lower(*args).compile().as_text()


SR_CASES = [  # (layers, DCs, domain, migration: SR 8x with ...)
    (2, 2, 2, Migration(compression=8.0, shared="mean")),
    (4, 4, 4, Migration(compression=8.0, shared="mean")),
    (2, 4, 4, Migration(compression=8.0, shared="persistent")),
    (2, 2, 2, Migration(compression=8.0, shared="none", grad_compression=8.0)),
    (2, 4, 2, Migration(compression=8.0, shared="persistent", grad_compression=4.0)),
]


@pytest.mark.parametrize("layers,dcs,domain,migration", SR_CASES, ids=str)
def test_sr_variants_move_in_the_program_what_volumes_and_cost_count(
    layers, dcs, domain, migration
):
    """The compiled gather, reference sync or refresh and (compressed) reduce-scatter across the
    DC level equal `xdc.volumes` for each SR variant; the cost model times those bytes."""
    mesh = make_mesh((dcs, 2), ("dc", "local"))
    topo = hep.Topology.from_mesh(mesh, levels=("dc", "local"))
    hlo = _compressed_step(mesh, topo, migration.with_domains({"dc": domain}), layers)
    axes = {"dc", "dc" + domains.INNER_SUFFIX}
    # Arrays of rank >= 1: the scalar loss's all-reduce is not the model's.
    moved = traffic.crossing_bytes(hlo, axes, operands=lambda kind, shape: len(shape) >= 1)
    vols = volumes.expected_volumes(
        (dcs, 2),
        (domain, 1),
        tokens=1,
        top_k=1,
        num_experts=16,
        hidden=4,
        act_bytes=4,
        expert_matrices=((8, 12), (8, 12), (12, 8)),
        migration=migration,
    )
    level = vols.levels[0]
    p1 = 3 * 8 * 12 * 4
    shared, grad_compressed = migration.shared, migration.grad_compression is not None
    assert level.shared_sync_bytes == (2 * (domain - 1) * p1 // domain if shared == "mean" else 0)
    ranks = 2 * dcs  # the persistent refresh: one expert all-reduced over every rank
    refresh = 2 * p1 * (ranks - 2) // ranks if shared == "persistent" else 0
    assert level.shared_refresh_bytes == refresh
    assert moved["all-reduce"] == layers * (level.shared_sync_bytes + refresh)
    assert traffic.crossing_bytes(hlo, axes, op_name=migrate.REFRESH_SCOPE)["all-reduce"] == (
        layers * refresh
    )
    assert moved["all-gather"] == layers * level.gather_bytes
    # Gradients: a reduce-scatter at full size, or top-k blocks in an all-to-all.
    rs = moved["all-to-all"] if grad_compressed else moved["reduce-scatter"]
    assert rs == layers * level.reduce_scatter_bytes
    if grad_compressed:
        assert moved["reduce-scatter"] == 0 and rs < layers * level.gather_experts * p1
    # One call's matrices (every layer's here) travel together: one gather per element type
    # (values, indices), not one per matrix.
    assert len(traffic.collectives(hlo, "all-gather")) <= 2
    # The cost model times exactly those bytes (no ring factor of its own on top).
    c = cost.step_cost(cost.Cluster((dcs, 2), (cost.Link(1e9),) * 2), vols, training=False)
    assert c.levels[0].shared_sync == pytest.approx(level.shared_sync_bytes / 1e9, rel=1e-12)
    assert c.levels[0].refresh == pytest.approx(refresh / 1e9, rel=1e-12)
    assert level.token_bytes == 0 or dcs != domain  # a DC-wide domain: no token crosses
    assert c.levels[0].bytes == pytest.approx(
        level.token_bytes * 2 + level.gather_bytes + level.shared_sync_bytes + refresh
    )
