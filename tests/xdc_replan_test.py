"""The planner's memory limit and per-layer plans, and re-planning (`xdc.replan`, `Replanner`)
on injected changes: a link-bandwidth drop and a routing skew (pure model, no devices)."""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest

from jax_hybridep import xdc
from jax_hybridep.xdc.model import cost, planner

GBPS = 1e9 / 8


def _cluster(wan_gbps=10.0, latency_ms=5.0, node_gbps=1.0):
    """The cross_dc example's 2 DCs x 2 nodes x 2 GPUs."""
    wan = wan_gbps * GBPS
    links = (
        cost.Link(wan, latency_ms * 1e-3, uplink=wan),
        cost.Link(node_gbps * GBPS, 5e-6),
        cost.Link(3600 * GBPS, 2e-6),
    )
    return cost.Cluster((2, 2, 2), links, ("dc", "node", "local"))


def _workload(**kw):
    """The example model's step: 2 layers of 8 experts (three 128 x 256 float32 matrices)."""
    d, f = 128, 256
    base = dict(
        tokens=256,
        top_k=2,
        num_experts=8,
        hidden=d,
        act_bytes=4,
        expert_matrices=((d, f), (d, f), (f, d)),
        value_bytes=4,
        layers=2,
        dense_bytes=797_184,
        prefetch=True,
    )
    return xdc.Workload(**{**base, **kw})


P1 = 3 * 128 * 256 * 4
SR = xdc.Migration(compression=10.0, sync_every=10, grad_compression=10.0)


def test_memory_counts_every_layers_replicas_residuals_and_shared_experts():
    w = _workload(layers=3, resident_bytes=10**6, prefetch=False)
    sizes = (2, 2, 2)
    # One expert per rank: S - 1 replicas per layer, every layer's held for the backward.
    assert w.memory_bytes(sizes, (2, 1, 2)) == 10**6 + 3 * 3 * P1
    assert w.memory_bytes(sizes, (1, 1, 1)) == 10**6
    fwd = dataclasses.replace(w, training=False)
    assert fwd.memory_bytes(sizes, (2, 1, 2)) == 10**6 + 3 * P1  # one layer at a time
    assert dataclasses.replace(fwd, prefetch=True).memory_bytes(sizes, (2, 1, 2)) == 10**6 + 9 * P1
    # Gradient compression keeps, per inner level, the gradient entering its reduce-scatter
    # (2 then 4 slots); SR's persistent shared expert is one more expert.
    sr = dataclasses.replace(w, migration=xdc.Migration(compression=10.0, grad_compression=10.0))
    assert sr.layer_memory_bytes(sizes, (2, 1, 2)) == 3 * P1 + (2 + 4) * P1 + P1
    assert w.memory_bytes(sizes, [(2, 1, 2), (1, 1, 1), (2, 2, 2)]) == 10**6 + (3 + 0 + 7) * P1


def test_memory_limit_gives_the_fastest_feasible_domains():
    w = _workload(resident_bytes=5 * 10**6)
    cluster = _cluster(wan_gbps=0.3, node_gbps=100.0)
    sr = dataclasses.replace(w, migration=SR)
    free = xdc.plan(cluster, sr)
    assert free.domains == (2, 2, 2)  # full replication: every GPU holds every expert
    limit = free.best.memory_bytes - 1
    p = xdc.plan(cluster, sr, memory_limit_bytes=limit)
    assert p.best.memory_bytes <= limit and p.domains != (2, 2, 2)
    feasible = [c for c in p.candidates if c.memory_bytes <= limit]
    assert all(c.feasible == (c.memory_bytes <= limit) for c in p.candidates)
    assert p.time == min(c.time for c in feasible)
    assert "(over memory)" in p.table()
    with pytest.raises(ValueError, match="even plain EP needs 5,000,000 bytes per rank"):
        xdc.plan(cluster, sr, memory_limit_bytes=4 * 10**6)
    with pytest.raises(ValueError, match="memory_limit_bytes must be an int >= 0, got -1"):
        xdc.plan(cluster, sr, memory_limit_bytes=-1)


def test_per_layer_plans_where_the_memory_fits_some_layers_replicas():
    """A limit with room for one layer's replicas: each layer picks its own domains; the answer
    is the best of every per-layer assignment under the full step model."""
    w = _workload(migration=SR, prefetch=False)
    cluster = _cluster(wan_gbps=0.3, node_gbps=100.0)
    # (2, 1, 1): one replica, its residuals on the DC level (2 slots), the shared expert.
    limit = w.layer_memory_bytes((2, 2, 2), (2, 1, 1))
    assert limit == 4 * P1
    p = xdc.plan(cluster, w, memory_limit_bytes=limit, per_layer=True)
    uniform = xdc.plan(cluster, w, memory_limit_bytes=limit)
    assert uniform.domains == (1, 1, 1)  # no domain fits both layers
    assert p.domains is None and sorted(p.layer_domains) == [(1, 1, 1), (2, 1, 1)]
    assert p.best.memory_bytes <= limit and p.time < 0.9 * uniform.time
    cands = [c.domains for c in uniform.candidates]
    brute = min(
        (
            planner.evaluate(cluster, w, pair, memory_limit_bytes=limit)
            for pair in itertools.product(cands, repeat=2)
        ),
        key=lambda c: (not c.feasible, c.time),
    )
    assert p.time == pytest.approx(brute.time, rel=1e-12)
    assert "per layer" in p.table()


def test_step_cost_sums_per_layer_volumes_and_counts_the_dense_all_reduce_once():
    w = _workload(prefetch=False)
    cluster = _cluster()
    a, b = (w.volumes(cluster.level_sizes, d) for d in ((2, 1, 2), (1, 1, 1)))
    both = cost.step_cost(cluster, [a, b])
    one = {v: cost.step_cost(cluster, v) for v in (a, b)}
    dense = one[a].dense
    assert dense > 0 and both.dense == pytest.approx(dense)
    assert both.comm == pytest.approx(one[a].comm + one[b].comm - dense, rel=1e-12)
    # Prefetch fuses every layer's gather into one collective per level: one message per peer.
    fused = cost.step_cost(cluster, [a, a], prefetch=True)
    apart = cost.step_cost(cluster, [a, a])
    # One gather and one reduce-scatter message saved on each split level (5 ms across the
    # DCs, 2 us inside a node).
    assert fused.comm == pytest.approx(apart.comm - 2 * (5e-3 + 2e-6), rel=1e-9)


def _counts(skewed: bool):
    """Rows per expert of 2 layers: uniform, or every token on experts 0 and 1 (one node)."""
    row = np.array([256, 256, 0, 0, 0, 0, 0, 0]) if skewed else np.full(8, 64)
    return np.stack([row, row])


def test_replanner_switches_on_a_bandwidth_drop_and_on_a_routing_skew():
    schedule = xdc.LinkSchedule.parse("10:dc=0.5", ["dc", "node", "local"])
    r = xdc.Replanner(
        _cluster(), _workload(), every=5, schedule=schedule, min_gain=0.02, per_layer=False
    )
    assert r.layer_domains == [(2, 1, 2)] * 2  # 10 Gbps: experts cross the WAN
    assert not r.due(3) and r.due(5)
    assert r.update(5, _counts(False)) is None  # nothing changed: keep the compiled step
    # The WAN drops to 0.5 Gbps: tokens are cheaper to send than experts.
    assert r.update(10, _counts(False)) == ((1, 1, 2), (1, 1, 2))
    # Every token on one node's experts: the busiest link carries more, migration pays again.
    assert r.update(15, _counts(True)) == ((2, 1, 2), (2, 1, 2))
    assert r.update(20, _counts(True)) is None
    steps = [(h["step"], h["changed"]) for h in r.history]
    assert steps == [(5, False), (10, True), (15, True), (20, False)]
    assert r.history[1]["gbps"]["dc"] == 0.5 and r.history[2]["skew"] == pytest.approx(4.0)
    assert all(h["chosen_s"] <= h["current_s"] for h in r.history)


def test_replan_keeps_the_plan_below_min_gain_and_leaves_one_that_no_longer_fits():
    w, cluster = _workload(), _cluster(wan_gbps=0.5)
    fresh = xdc.plan(cluster, w)
    kept = xdc.replan((2, 1, 2), cluster, w, min_gain=0.5)  # not 50 % faster: stay
    assert not kept.changed and kept.layer_domains == ((2, 1, 2), (2, 1, 2))
    moved = xdc.replan((2, 1, 2), cluster, w)
    assert moved.changed and moved.layer_domains == fresh.layer_domains
    limit = w.memory_bytes(cluster.level_sizes, (2, 2, 2)) - 1
    tight = xdc.replan((2, 2, 2), _cluster(), w, memory_limit_bytes=limit, min_gain=0.9)
    assert tight.changed and not tight.current.feasible
    assert math.prod(tight.layer_domains[0]) < 8


def test_links_and_schedules_parse_and_name_what_is_wrong():
    levels = {"dc": 2, "node": 2, "local": 2}
    c = xdc.parse_links("dc=10:5:shared,node=100,local=3600:0.002", levels)
    assert c.links[0] == cost.Link(10 * GBPS, 5e-3, uplink=10 * GBPS)
    assert c.links[1] == cost.Link(100 * GBPS) and c.links[2].alpha == pytest.approx(2e-6)
    for bad, message in (
        ("dc=10,node=100", "gives no link for the levels \\['local'\\]"),
        ("dc=0,node=1,local=1", "'dc=0' is not LEVEL=GBPS"),
        ("dc=1:1:wide,node=1,local=1", "'dc=1:1:wide' must name one of the levels"),
        ("rack=1,node=1,local=1", "'rack=1' must name one of the levels"),
    ):
        with pytest.raises(ValueError, match=message):
            xdc.parse_links(bad, levels)
    s = xdc.LinkSchedule.parse("10:dc=1;20:dc=0.1,node=50", list(levels))
    assert s.gbps_at(5) == {} and s.gbps_at(10) == {"dc": 1.0}
    assert s.gbps_at(25) == {"dc": 0.1, "node": 50.0}
    scaled = s.cluster_at(c, 20)
    assert scaled.links[0].bandwidth == scaled.links[0].uplink == pytest.approx(0.1 * GBPS)
    for bad, message in (
        ("x:dc=1", "'x:dc=1' is not STEP"),
        ("5:dc=1;2:dc=2", "must increase"),
        ("5:wan=1", "LEVEL one of"),
    ):
        with pytest.raises(ValueError, match=message):
            xdc.LinkSchedule.parse(bad, list(levels))
