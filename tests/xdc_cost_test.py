"""Cross-DC cost model: volumes of the runtime, the extended model, the planner, dense gradients.

Host-side numpy only (no devices, no compilation, no timing): volumes are checked against the
runtime's own definitions (`ExpertDomains.placement`, `compress`, `traffic`), the extended model
against the paper's stream model and by its terms; every public constructor rejects bad input
with a ValueError naming the value. The paper's numbers: tests/xdc_paper_test.py.
"""

import dataclasses
import itertools
import math
import re

import numpy as np
import pytest
from harness import routed_pairs
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_hybridep import traffic
from jax_hybridep.topology import Topology
from jax_hybridep.xdc import expert_wire
from jax_hybridep.xdc.migration import Migration
from jax_hybridep.xdc.model import cost, loads, planner, volumes
from jax_hybridep.xdc.runtime.domains import ExpertDomains

LEVELS = {
    (2, 4): ("dc", "local"),
    (4, 2): ("dc", "local"),
    (2, 2, 2): ("dc", "node", "local"),
    (2, 4, 2): ("dc", "node", "local"),
}


def _topology(sizes, names=None):
    names = names or tuple(f"l{i}" for i in range(len(sizes)))
    return Topology(levels=tuple((n,) for n in names), mesh_axes=names, mesh_shape=tuple(sizes))


def _routing(rng, ranks, tokens, k, experts, invalid=0.1, probs=None):
    idx = np.stack([rng.choice(experts, k, replace=False, p=probs) for _ in range(ranks * tokens)])
    idx[rng.random(idx.shape) < invalid] = -1
    return idx.reshape(ranks, tokens, k)


def _groups(sizes, domains, topk_idx, num_experts):
    """{inner coords: dest [N, T, K]} from the runtime's placement, grouped by a plain loop."""
    doms = ExpertDomains(_topology(sizes, LEVELS.get(tuple(sizes))), tuple(domains), None, None)
    placed = np.array([r for r, _ in doms.placement(num_experts)])
    outer = [g // s for g, s in zip(sizes, domains, strict=True)]
    token_sizes = [n for n in outer if n > 1]
    out = {}
    for rank in range(math.prod(sizes)):
        coords = np.unravel_index(rank, sizes)
        inner = tuple(int(c % s) for c, s in zip(coords, domains, strict=True))
        tok = [int(c // s) for c, s, n in zip(coords, domains, outer, strict=True) if n > 1]
        member = int(np.ravel_multi_index(tok, token_sizes)) if token_sizes else 0
        group = out.setdefault(inner, np.full((math.prod(token_sizes), *topk_idx.shape[1:]), -2))
        idx = topk_idx[rank]
        group[member] = np.where(idx >= 0, placed[np.maximum(idx, 0)], -1)
    return out, token_sizes


def _kw(**over):
    kw = dict(num_experts=32, hidden=8, act_bytes=2, expert_bytes=400)
    kw.update(over)
    return kw


# -- volumes ---------------------------------------------------------------------------------


def test_realisable_domains():
    doms = volumes.realisable_domains((4, 6))
    assert doms[0] == (1, 1) and len(doms) == 3 * 4 and len(set(doms)) == len(doms)
    assert all(4 % a == 0 and 6 % b == 0 for a, b in doms)


@settings(max_examples=12, deadline=None)
@given(
    case=st.sampled_from(
        [(s, d) for s in LEVELS for d in volumes.realisable_domains(s) if math.prod(d) < 16]
    ),
    seed=st.integers(0, 2**31),
    k=st.integers(1, 4),
)
def test_routed_copies_equal_the_independent_routed_pairs(case, seed, k):
    sizes, domains = case
    num_experts, tokens = 2 * math.prod(sizes), 6
    topk = _routing(np.random.default_rng(seed), math.prod(sizes), tokens, k, num_experts)
    vols = volumes.routed_volumes(sizes, domains, topk, **_kw(num_experts=num_experts))
    groups, token_sizes = _groups(sizes, domains, topk, num_experts)
    total = np.zeros(len(token_sizes), np.int64)
    for dest in groups.values():
        if token_sizes:
            total += routed_pairs(dest, _topology(token_sizes))
        copies, sent, recv = loads.exact_loads(dest, token_sizes)
        # Every copy is sent once and received once, by the ranks the hierarchical rule names.
        np.testing.assert_array_equal(copies.sum(0), sent.sum(0))
        np.testing.assert_array_equal(copies.sum(0), recv.sum(0))
    per_level = [v.token_copies * math.prod(sizes) for v in vols.levels if v.outer > 1]
    np.testing.assert_allclose(per_level, total, rtol=1e-12)
    assert all(v.token_copies == 0 for v in vols.levels if v.outer == 1)


def test_exact_loads_attribution_by_loop():
    """Sender = destination's coords below the level + source's from it; receiver = dest prefix."""
    sizes, rng = (2, 3, 2), np.random.default_rng(1)
    dest = rng.integers(-1, 12, size=(12, 5, 3))
    copies, sent, recv = loads.exact_loads(dest, sizes)
    ref = np.zeros((3, 12, 3), np.int64)
    for s, t, lvl in itertools.product(range(12), range(5), range(3)):
        sc = np.unravel_index(s, sizes)
        prefixes = set()
        for d in dest[s, t]:
            dc = np.unravel_index(d, sizes) if d >= 0 else None
            if dc is not None and dc[lvl] != sc[lvl]:
                prefixes.add(tuple(int(c) for c in dc[: lvl + 1]))
        for p in prefixes:
            ref[0, s, lvl] += 1
            ref[1, np.ravel_multi_index(p[:lvl] + sc[lvl:], sizes), lvl] += 1
            ref[2, np.ravel_multi_index(p + sc[lvl + 1 :], sizes), lvl] += 1
    np.testing.assert_array_equal(np.stack([copies, sent, recv]), ref)


@pytest.mark.parametrize("sizes", list(LEVELS))
@pytest.mark.parametrize("k", [1, 2, 5])
def test_expected_copies_formula(sizes, k):
    e, t = 4 * math.prod(sizes), 100
    for domains in volumes.realisable_domains(sizes):
        vols = volumes.expected_volumes(sizes, domains, tokens=t, top_k=k, **_kw(num_experts=e))
        outer, above = [g // s for g, s in zip(sizes, domains, strict=True)], 1
        for v, n in zip(vols.levels, outer, strict=True):
            e_p = e // (above * n)
            want = t * above * (n - 1) * (1 - math.comb(e - e_p, k) / math.comb(e, k))
            assert v.token_copies == pytest.approx(want, rel=1e-12, abs=1e-12)
            assert v.token_copies_max == pytest.approx(want, rel=1e-12, abs=1e-12)
            assert v.token_site_copies_max == pytest.approx(v.site_ranks * want, rel=1e-12)
            above *= n


def test_expected_matches_monte_carlo():
    sizes, domains, k, e, t = (2, 4, 2), (2, 1, 1), 3, 32, 300
    topk = _routing(np.random.default_rng(0), 16, t, k, e, invalid=0.0)
    routed = volumes.routed_volumes(sizes, domains, topk, **_kw())
    expected = volumes.expected_volumes(sizes, domains, tokens=t, top_k=k, **_kw())
    for r, x in zip(routed.levels, expected.levels, strict=True):
        assert r.token_copies == pytest.approx(x.token_copies, rel=0.03)


def test_skewed_routing_loads_the_hot_rank():
    sizes, e, k, t = (2, 4), 16, 2, 200
    probs = np.ones(e)
    probs[0] = 20  # expert 0 (on rank 0) is hot
    kw = _kw(num_experts=e)
    skew = volumes.expected_volumes(sizes, (1, 1), tokens=t, top_k=k, expert_probs=probs, **kw)
    flat = volumes.expected_volumes(sizes, (1, 1), tokens=t, top_k=k, **kw)
    same = volumes.expected_volumes(sizes, (1, 1), tokens=t, top_k=k, expert_probs=[1] * e, **kw)
    assert same == flat
    for s, u in zip(skew.levels, flat.levels, strict=True):
        assert s.token_copies_max > 1.2 * s.token_copies and s.token_copies < u.token_copies
    topk = _routing(np.random.default_rng(0), 8, t, k, e, invalid=0.0, probs=probs / probs.sum())
    routed = volumes.routed_volumes(sizes, (1, 1), topk, **kw)
    for r, s in zip(routed.levels, skew.levels, strict=True):
        assert r.token_copies_max == pytest.approx(s.token_copies_max, rel=0.15)


@pytest.mark.parametrize("sizes", list(LEVELS))
def test_gather_reduce_scatter_and_padded_bytes(sizes):
    e, p1, t, h = 2 * math.prod(sizes), 400, 7, 8
    e_local = e // math.prod(sizes)
    for domains in volumes.realisable_domains(sizes):
        vols = volumes.expected_volumes(
            sizes, domains, tokens=t, top_k=2, **_kw(num_experts=e, expert_bytes=p1)
        )
        held = 1
        for v, s in zip(vols.levels, domains, strict=True):
            assert v.gather_experts == (s - 1) * held * e_local
            assert v.gather_bytes == v.reduce_scatter_bytes == v.gather_experts * p1
            assert v.shared_sync_bytes == 0 and v.gather_peers == s - 1
            held *= s
        assert sum(v.gather_experts for v in vols.levels) == (math.prod(domains) - 1) * e_local
        token_sizes = volumes.token_level_sizes(sizes, domains)
        if token_sizes:
            want = traffic.padded_level_bytes(_topology(token_sizes), t, h, np.float16)
            assert [v.padded_token_bytes for v in vols.levels if v.outer > 1] == want
        train, fwd = vols.step_bytes(training=True), vols.step_bytes(training=False)
        assert train == pytest.approx([4 * v.token_bytes + 2 * v.gather_bytes for v in vols.levels])
        assert fwd == pytest.approx([2 * v.token_bytes + v.gather_bytes for v in vols.levels])


@pytest.mark.parametrize("compression", [None, 0.5, 1.0, 2.0, 7.3, 50.0, 1e9])
@pytest.mark.parametrize(
    "dtype,shape", [(np.float32, (64, 48)), (np.float16, (33, 7)), ("bfloat16", (5,))]
)
def test_compressed_bytes_match_runtime(compression, dtype, shape):
    import ml_dtypes  # noqa: F401  (numpy bfloat16)

    dt = np.dtype(dtype)
    n = math.prod(shape)
    runtime = None if compression is None or compression <= 1 else compression
    assert expert_wire.expert_wire_bytes(
        [shape, n], compression, dt.itemsize
    ) == 2 * expert_wire.sent_bytes(shape, dt, runtime)
    if runtime:
        assert expert_wire.topk_count(n, compression, dt.itemsize) == expert_wire.kept_entries(
            n, dt, compression
        )


def test_compressed_volumes():
    """SR compression shrinks the gather; the reference costs what its variant moves: "mean" an
    all-reduce over the domain every layer call, "persistent" one over all ranks every
    `sync_every` steps, "none" nothing; gradient compression shrinks the reduce-scatter alike."""
    sizes, domains, mats = (2, 4), (2, 2), [(16, 32), (32, 16)]
    p1 = 2 * 16 * 32 * 4

    def vols(**kw):
        return volumes.expected_volumes(
            sizes,
            domains,
            tokens=4,
            top_k=2,
            **_kw(expert_bytes=None, expert_matrices=mats),
            migration=Migration(compression=8, **kw),
        )

    sent = 2 * expert_wire.topk_count(512, 8, 4) * 8
    mean, persistent = vols(shared="mean"), vols(sync_every=5)
    none, both = vols(shared="none"), vols(grad_compression=8)
    assert sent < p1 and mean.expert_bytes == p1
    # The persistent refresh all-reduces one expert over the 8 ranks: across the level of 2,
    # 4 peers (2 * 4 / 8 of it); across the level of 4, 6 peers.
    refresh = (p1, 3 * p1 // 2)
    levels = zip(*(v.levels for v in (mean, persistent, none, both)), strict=True)
    for lvl, (m, p, n, b) in enumerate(levels):
        for v in (m, p, n, b):
            assert v.gather_bytes == v.gather_experts * sent
        assert m.reduce_scatter_bytes == p.reduce_scatter_bytes == m.gather_experts * p1
        assert b.reduce_scatter_bytes == b.gather_experts * sent  # the same top-k rule
        assert m.shared_sync_bytes == p1 and m.shared_refresh_bytes == 0
        assert p.shared_sync_bytes == 0 and p.shared_refresh_bytes == refresh[lvl]
        assert n.shared_sync_bytes == n.shared_refresh_bytes == 0
    expected = [
        4 * v.token_bytes + v.gather_bytes + v.reduce_scatter_bytes + r / 5
        for v, r in zip(persistent.levels, refresh, strict=True)
    ]
    assert persistent.step_bytes(training=True) == pytest.approx(expected, rel=1e-12)
    plain = volumes.expected_volumes(
        sizes,
        (1, 1),
        tokens=4,
        top_k=2,
        **_kw(expert_bytes=None, expert_matrices=mats),
        migration=Migration(compression=8),
    )
    assert all(v.shared_refresh_bytes == 0 for v in plain.levels)  # nothing migrates


def test_flat_volumes():
    sizes, t, k = (2, 8), 64, 2
    tutel = volumes.flat_volumes(
        sizes, tokens=t, top_k=k, num_experts=32, hidden=4, act_bytes=2, dedup=False
    )
    assert [v.token_copies for v in tutel.levels] == [t * k * 8 / 16, t * k * 7 / 16]
    dedup = volumes.flat_volumes(sizes, tokens=t, top_k=k, num_experts=32, hidden=4, act_bytes=2)
    per_peer = t * (1 - math.comb(30, k) / math.comb(32, k))
    assert [v.token_copies for v in dedup.levels] == pytest.approx([8 * per_peer, 7 * per_peer])


def test_volume_errors():
    with pytest.raises(ValueError, match="divide"):
        volumes.expected_volumes((2, 4), (2, 3), tokens=1, top_k=1, **_kw())
    with pytest.raises(ValueError, match="exactly one"):
        volumes.expected_volumes((2, 4), (1, 1), tokens=1, top_k=1, **_kw(expert_matrices=[4]))
    with pytest.raises(ValueError, match=r"\[G=8, T, K\]"):
        volumes.routed_volumes((2, 4), (1, 1), np.zeros((4, 2, 1), int), **_kw())


# -- the extended model ----------------------------------------------------------------------


@pytest.mark.parametrize("g,lat_pe", [(8, 0.0), (8, 2e-4), (16, 1e-3)])
def test_extended_model_reduces_to_stream_model(g, lat_pe):
    """One level, top-1, no latency, no uplink, forward only: exactly the paper's Lat(S)."""
    t, h, ab, e, p1, b = 1000, 256, 2, 2 * g, 50_000, 5e9
    d, p_e = t * h * ab, 2 * p1
    cluster = cost.Cluster((g,), (cost.Link(b),))
    for s in cost.divisors(g):
        vols = volumes.expected_volumes(
            (g,), (s,), tokens=t, top_k=1, num_experts=e, hidden=h, act_bytes=ab, expert_bytes=p1
        )
        got = cost.step_cost(cluster, vols, training=False, compute=lat_pe, lat_pe=lat_pe)
        want = cost.stream_latency(s, g=g, d=d, p_e=p_e, bandwidth=b, lat_pe=lat_pe)
        assert got.time == pytest.approx(want, rel=1e-12)


def test_extended_model_terms():
    sizes, t, h, ab = (2, 4), 100, 64, 2
    kw = dict(tokens=t, top_k=2, num_experts=16, hidden=h, act_bytes=ab, expert_bytes=1000)
    wan = cost.Link(1e8, alpha=1e-3, uplink=2e8)
    cluster = cost.Cluster(sizes, (wan, cost.Link(1e10)))
    vols = volumes.expected_volumes(sizes, (2, 1), **kw)
    c = cost.step_cost(cluster, vols, layers=3, compute=0.5)
    v0, v1 = vols.levels
    gather = max(v0.gather_bytes / 1e8, 4 * v0.gather_bytes / 2e8) + 1e-3
    tokens = v1.token_bytes / 1e10
    assert c.exposed_gather == pytest.approx(3 * gather)
    assert c.reduce_scatter == pytest.approx(3 * gather)  # same bytes, uncompressed
    assert c.tokens == pytest.approx(3 * 4 * tokens)
    assert c.time == pytest.approx(0.5 + 3 * (2 * gather + 4 * tokens))
    assert c.bytes_per_level == pytest.approx([3 * 2 * v0.gather_bytes, 3 * 4 * v1.token_bytes])
    hidden = cost.step_cost(cluster, vols, layers=3, lat_pe=1.0)
    assert hidden.exposed_gather == 0 and hidden.comm == pytest.approx(c.comm - 3 * gather)
    # Flat: both levels at once, the slower sets the time.
    flat = volumes.flat_volumes(sizes, tokens=t, top_k=2, num_experts=16, hidden=h, act_bytes=ab)
    f = cost.step_cost(cluster, flat, training=False)
    per = [
        cost.transfer_time(lk, v.token_bytes, v.token_site_bytes_max, v.token_peers)
        for lk, v in zip(cluster.links, flat.levels, strict=True)
    ]
    assert f.comm == pytest.approx(2 * max(per))


# -- the planner -----------------------------------------------------------------------------


@settings(max_examples=15, deadline=None)
@given(
    sizes=st.sampled_from(list(LEVELS)),
    wan=st.floats(1e7, 1e11),
    alpha=st.floats(0, 1e-2),
    tokens=st.integers(1, 4096),
    p1=st.integers(1, 10**7),
    compression=st.sampled_from([None, 20.0]),
    lat_pe=st.floats(0, 1e-2),
)
def test_plan_never_worse_than_plain_ep(sizes, wan, alpha, tokens, p1, compression, lat_pe):
    cluster = cost.Cluster(
        sizes, (cost.Link(wan, alpha, uplink=wan),) + (cost.Link(1e11),) * (len(sizes) - 1)
    )
    w = planner.Workload(
        tokens=tokens,
        top_k=2,
        num_experts=2 * math.prod(sizes),
        hidden=512,
        act_bytes=2,
        expert_bytes=4 * p1,
        migration=Migration(compression=compression),
        layers=2,
        lat_pe=lat_pe,
    )
    p = planner.plan(cluster, w)
    assert p.time <= p.plain_ep.time and p.plain_ep.domains == (1,) * len(sizes)
    assert p.time == min(c.time for c in p.candidates)
    assert len(p.candidates) == len(volumes.realisable_domains(sizes))


def test_plan_choices_and_routed():
    sizes = (2, 4)
    w = planner.Workload(
        tokens=2048, top_k=2, num_experts=16, hidden=1024, act_bytes=2, expert_bytes=400_000
    )
    slow = cost.Cluster(sizes, (cost.Link(1e8, uplink=1e8), cost.Link(1e11)), ("dc", "local"))
    assert planner.plan(slow, w).domains[0] == 2  # experts cross the slow link, tokens do not
    heavy = planner.Workload(
        tokens=4, top_k=1, num_experts=16, hidden=64, act_bytes=2, expert_bytes=10**8
    )
    assert planner.plan(slow, heavy).domains == (1, 1)
    assert "| (1, 1) |" in planner.plan(slow, heavy).table()
    topk = _routing(np.random.default_rng(0), 8, 64, 2, 16)
    p = planner.plan(slow, w, topk)
    exact = volumes.routed_volumes(
        sizes, p.domains, topk, num_experts=16, hidden=1024, act_bytes=2, expert_bytes=400_000
    )
    assert p.best.volumes == exact and p.bytes_per_level == pytest.approx(exact.step_bytes())


# -- validation -------------------------------------------------------------------------------


def test_public_constructors_name_the_bad_value():
    with pytest.raises(ValueError, match="bandwidth=0"):
        cost.Link(0)
    with pytest.raises(ValueError, match="Link.alpha must be a finite number, got nan"):
        cost.Link(1e9, alpha=float("nan"))
    with pytest.raises(ValueError, match="uplink=-1"):
        cost.Link(1e9, uplink=-1)
    link = cost.Link(1e9)
    with pytest.raises(ValueError, match=r"level_sizes must be >= 1.*\(2, 0\)"):
        cost.Cluster((2, 0), (link, link))
    with pytest.raises(ValueError, match=r"level_sizes must be integers, got \(2.5,\)"):
        cost.Cluster((2.5,), (link,))
    with pytest.raises(ValueError, match="one link per level"):
        cost.Cluster((2, 4), (link,))
    with pytest.raises(ValueError, match="must be cost.Link values"):
        cost.Cluster((2,), (1e9,))
    with pytest.raises(ValueError, match=r"names \('dc', 'dc'\)"):
        cost.Cluster((2, 4), (link, link), ("dc", "dc"))
    kw = dict(tokens=4, top_k=2, num_experts=16, hidden=8, act_bytes=2, expert_bytes=400)
    for bad, message in (
        (dict(tokens=-1), "Workload.tokens must be an integer >= 0, got -1"),
        (dict(top_k=17), "top_k=17 exceeds num_experts=16"),
        (dict(hidden=0), "Workload.hidden must be an integer >= 1, got 0"),
        (dict(layers=1.5), "Workload.layers must be an integer >= 1, got 1.5"),
        (dict(compute=-1.0), "Workload.compute must be seconds >= 0, got -1.0"),
        (dict(dense_bytes=-8), "Workload.dense_bytes must be an integer >= 0, got -8"),
        (dict(migration=Migration({"dc": 2})), "the planner chooses them"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            planner.Workload(**{**kw, **bad})
    for bad, message in (
        (dict(compression=-2.0), "compression must be None or a finite number > 0, got -2.0"),
        (dict(compression="10"), "compression must be None or a number > 0, got '10'"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            Migration(**bad)
    with pytest.raises(TypeError, match="Workload.migration must be a jax_hybridep.xdc.Migr"):
        planner.Workload(**kw, migration=10.0)
    cluster, w = cost.Cluster((2, 4), (link, link)), planner.Workload(**kw)
    with pytest.raises(ValueError, match=r"candidates \[\(3, 1\)\] are not domain tuples"):
        planner.plan(cluster, w, candidates=[(3, 1)])
    with pytest.raises(ValueError, match="cluster must be a cost.Cluster, got tuple"):
        planner.plan((2, 4), w)
    with pytest.raises(ValueError, match="routing must be 'uniform'"):
        planner.plan(cluster, w, "zipf")
    vols = w.volumes((2, 4), (1, 1))
    with pytest.raises(ValueError, match="layers must be an integer >= 1, got 0"):
        cost.step_cost(cluster, vols, layers=0)
    with pytest.raises(ValueError, match="lat_pe must be a finite number of seconds >= 0"):
        cost.step_cost(cluster, vols, lat_pe=-1.0)


# -- dense gradients -----------------------------------------------------------------------------


def test_dense_gradients_are_one_all_reduce_per_step_over_every_rank():
    sizes, dense = (2, 4), 8000
    kw = dict(tokens=64, top_k=2, num_experts=16, hidden=8, act_bytes=2, expert_bytes=400)
    with_dense = volumes.expected_volumes(sizes, (2, 1), dense_bytes=dense, **kw)
    without = volumes.expected_volumes(sizes, (2, 1), **kw)
    # 8 ranks: across the DC level 4 of them (2 * 4 / 8 of the bytes), across the GPU level 6.
    assert [v.dense_sync_bytes for v in with_dense.levels] == [dense, 2 * dense * 6 // 8]
    assert [v.dense_peers for v in with_dense.levels] == [1, 3]  # messages: a ring per level
    for layers in (1, 3):
        train = with_dense.step_bytes(True, layers)
        base = without.step_bytes(True, layers)
        assert [a - b for a, b in zip(train, base, strict=True)] == [dense, 12000]
        assert with_dense.step_bytes(False, layers) == without.step_bytes(False, layers)
    cluster = cost.Cluster(sizes, (cost.Link(1e8), cost.Link(1e10)))
    c = cost.step_cost(cluster, with_dense, layers=3)
    assert c.dense == pytest.approx(dense / 1e8 + 12000 / 1e10)
    assert c.comm == pytest.approx(cost.step_cost(cluster, without, layers=3).comm + c.dense)
    w = planner.Workload(**kw, dense_bytes=dense, layers=3)
    p = planner.plan(cluster, w)
    assert p.bytes_per_level[0] == pytest.approx(
        planner.plan(cluster, dataclasses.replace(w, dense_bytes=0)).bytes_per_level[0] + dense
    )
