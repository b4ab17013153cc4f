"""The level accounting (jax_hybridep/level_traffic.py): what padded and ragged levels send and
allocate, against routings counted by hand and the ragged route's own run-time counts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import make_mesh, random_routing, routed_pairs
from route_kinds import ROUTES, on_mesh

import jax_hybridep as hep
from jax_hybridep import fp8, level_traffic
from jax_hybridep.exchange import routes


def _topology(sizes) -> hep.Topology:
    axes = tuple(f"a{i}" for i in range(len(sizes)))
    return hep.Topology(levels=tuple((a,) for a in axes), mesh_axes=axes, mesh_shape=sizes)


def test_slot_bytes_are_payload_and_metadata():
    assert level_traffic.slot_bytes(7168, jnp.bfloat16, 8) == 7168 * 2 + 12 * 8
    assert level_traffic.slot_bytes(256, jnp.bfloat16, 2, "float8_e4m3fn") == (
        fp8.wire_bytes(256) + 24
    )


def test_copies_by_hand_flat():
    """4 ranks, 2 tokens, top-2: a copy per (token, other destination rank)."""
    dest = np.array(
        [
            [[1, 1], [0, 2]],  # rank 0: token 0 to rank 1 (twice: one copy), token 1 to 2
            [[-1, -1], [1, 1]],  # rank 1: nothing, then only itself
            [[0, 3], [3, -1]],  # rank 2: two copies, then one
            [[0, 1], [2, 0]],  # rank 3: two, two
        ]
    )
    topo = _topology((4,))
    copies = level_traffic.level_copies(dest, topo)
    np.testing.assert_array_equal(copies[:, 0], [2, 0, 3, 4])
    slot = level_traffic.slot_bytes(16, np.float32, 2)
    sent = level_traffic.sent_bytes(
        topo, ("ragged",), copies, tokens=2, hidden=16, dtype=np.float32, k=2, rows=16
    )
    np.testing.assert_array_equal(sent[:, 0], copies[:, 0] * slot + 3 * 4 * 4)
    padded = level_traffic.sent_bytes(
        topo, ("padded",), copies, tokens=2, hidden=16, dtype=np.float32, k=2, rows=16
    )
    np.testing.assert_array_equal(padded[:, 0], 3 * 2 * slot)  # (S - 1) * T slots, any routing


def test_copies_by_hand_two_levels():
    """node x local = 2 x 2: the node level's copy is sent by the source, the local level's by
    the rank of the destination node that holds it (the source's local coordinate there)."""
    topo = _topology((2, 2))
    dest = np.full((4, 1, 2), -1)
    dest[0, 0] = [3, 2]  # rank 0 -> node 1 once; there rank 2 keeps its row and sends one to 3
    dest[1, 0] = [1, 0]  # rank 1 stays on node 0; sends one copy to rank 0 over local
    copies = level_traffic.level_copies(dest, topo)
    np.testing.assert_array_equal(copies, [[1, 0], [0, 1], [0, 1], [0, 0]])
    np.testing.assert_array_equal(copies.sum(0), routed_pairs(dest, topo))


@pytest.mark.parametrize("sizes", [(8,), (2, 4), (2, 2, 2)])
def test_copies_sum_to_routed_pairs(sizes):
    topo = _topology(sizes)
    ranks, tokens, k = topo.ep_size, 12, 3
    rng = np.random.default_rng(len(sizes))
    dest = rng.integers(-1, ranks, (ranks, tokens, k))
    copies = level_traffic.level_copies(dest, topo)
    np.testing.assert_array_equal(copies.sum(0), routed_pairs(dest, topo))


def test_buffers_padded_and_ragged():
    topo = _topology((2, 4))
    T, K, C = 16, 4, 40
    assert level_traffic.buffer_slots(topo, ("padded", "padded"), T, K, C) == [
        (32, 32),
        (128, 128),
    ]
    assert level_traffic.buffer_slots(topo, ("ragged", "ragged"), T, K, C) == [
        (16 * 2, 32),
        (32 * 4, 40),
    ]


@pytest.mark.parametrize(
    "shape,axes,fields",
    [
        ((4,), ("ep",), {}),
        ((2, 4), ("node", "local"), {}),
        ((2, 4), ("node", "local"), {"capacity_factor": 1.0}),
    ],
)
def test_ragged_route_sends_its_real_items(shape, axes, fields):
    """The ragged route on CPU (the stand-in's exchanges): each shard's run-time copies per level
    are the routing's (`level_copies`, per sending rank), and its bytes those copies' slots."""
    mesh = make_mesh(shape, axes)
    topo = hep.Topology.from_mesh(mesh, axes)
    ranks, tokens, k, experts = topo.ep_size, 6, 3, 2 * topo.ep_size
    cfg = hep.DispatchConfig(num_experts=experts, **fields)
    kind = ROUTES["xla_ragged"]
    assert level_traffic.route_sends(kind.route(topo)) == ("ragged",) * len(axes)
    assert level_traffic.route_sends(routes.route_for("xla", topo)) == ("padded",) * len(axes)

    def fn(x, idx, w):
        d = kind.dispatch(x, idx, w, topology=topo, config=cfg)
        return d.stats.level_rows[None], d.kept, jnp.int32(d.tokens.shape[0])[None]

    rng = np.random.default_rng(7)
    idx, w = random_routing(rng, ranks * tokens, k, experts, invalid_fraction=0.1)
    x = rng.standard_normal((ranks * tokens, 8)).astype(np.float32)
    level_rows, kept, rows = jax.device_get(on_mesh(mesh, fn)(x, idx, w))
    dest = np.where(np.asarray(kept), np.asarray(idx) // (experts // ranks), -1)
    dest = dest.reshape(ranks, tokens, k)
    np.testing.assert_array_equal(level_rows, level_traffic.level_copies(dest, topo))
    sent = level_traffic.sent_bytes(
        topo,
        ("ragged",) * len(axes),
        level_rows,
        tokens=tokens,
        hidden=8,
        dtype=np.float32,
        k=k,
        rows=int(rows[0]),
    )
    slot = 8 * 4 + 12 * k
    gathers = np.array([(s - 1) * s * 4 for s in topo.level_sizes])
    np.testing.assert_array_equal(sent, level_rows * slot + gathers)


def test_bad_arguments_name_themselves():
    topo = _topology((2, 2))
    with pytest.raises(ValueError, match="one kind per level"):
        level_traffic.buffer_slots(topo, ("ragged",), 4, 2, 8)
    with pytest.raises(ValueError, match="sends"):
        level_traffic.buffer_slots(topo, ("ragged", "dense"), 4, 2, 8)
    with pytest.raises(ValueError, match="one count per level"):
        level_traffic.sent_bytes(
            topo, ("ragged",) * 2, [1], tokens=4, hidden=8, dtype=np.float32, k=2, rows=8
        )
    with pytest.raises(ValueError, match="dest"):
        level_traffic.level_copies(np.zeros((3, 2, 2), int), topo)


def test_bytes_table_counts_what_the_accounting_counts(capsys):
    """`python -m jax_hybridep.bench.bytes` at small sizes: the padded column is (S - 1) * M slots
    per rank, the routing it counts sums to `harness.routed_pairs`, capacity shrinks the ragged
    receive buffer only."""
    from jax_hybridep.bench import bytes as bench_bytes

    bench_bytes.main(["--tokens", "16", "--hidden", "64", "--topologies", "4,2x2"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 + 2 * (1 + 2)  # header, rule; 2 routings x (1 + 2 levels)
    slot = level_traffic.slot_bytes(64, "bfloat16", 8)
    flat = lines[2].split(" | ")
    assert flat[:3] == ["| 4", "uniform", "ep"] and float(flat[3]) == round(3 * 16 * slot / 1e6)
    topo = bench_bytes.topology("2x2")
    dest = bench_bytes.routing_dest(topo, "deepseek", 16, 8, 0)
    np.testing.assert_array_equal(
        level_traffic.level_copies(dest, topo).sum(0), routed_pairs(dest, topo)
    )
    big = bench_bytes.topology("4x4")  # 16 ranks: 16 T slots padded, C = 10 T at f = 1.25
    for f, smaller in ((None, False), (1.25, True)):
        rows = bench_bytes.plan_rows(big, 16, 8, f)
        padded = bench_bytes.buffers(big, ("padded",) * 2, 16, 8, rows, slot)
        ragged = bench_bytes.buffers(big, ("ragged",) * 2, 16, 8, rows, slot)
        assert padded[0] == 16 * 16 * slot
        assert ragged[0] == (10 * 16 * slot if smaller else padded[0])
