"""Tests of the cross-DC network simulator `jax_hybridep.sim` (pure numpy; no devices used)."""

import dataclasses

import numpy as np
import pytest

from jax_hybridep import sim
from jax_hybridep.sim import Congestion, Datacenters, Flows, MoELayer, Network
from jax_hybridep.sim.__main__ import main, parser
from jax_hybridep.sim.sweep import BANDWIDTHS_GBPS

ENGINES = (sim.simulate, sim.simulate_reference)

# No latency, no per-message cost, no congestion, no compute: times are pure bandwidth.
BARE = dict(wan_latency_s=0.0, intra_latency_s=0.0, msg_overhead_s=0.0, congestion_exponent=0.0)
NO_COMPUTE = MoELayer(data_bytes=1e9, expert_bytes=1e8, compute_s=0.0, pre_expert_s=0.0)


def _flows(paths, path, size, start=None, count=None, floor=None):
    n = len(path)
    return Flows(
        paths=np.array(paths, dtype=bool),
        path=np.array(path),
        count=np.ones(n) if count is None else np.array(count, dtype=float),
        size=np.array(size, dtype=float),
        start=np.zeros(n) if start is None else np.array(start, dtype=float),
        tag=np.zeros(n, dtype=int),
        floor=floor,
    )


def _net(*caps, mult=None):
    return Network(
        np.array(caps, float),
        np.ones(len(caps)) if mult is None else np.array(mult),
        tuple(f"l{i}" for i in range(len(caps))),
    )


# --- water-filling -------------------------------------------------------------------------------


def test_two_flows_share_a_link_equally():
    np.testing.assert_allclose(sim.max_min_rates([[1.0], [1.0]], [10.0]), [5.0, 5.0])


def test_flow_limited_elsewhere_frees_bandwidth():
    # f0 crosses links A (10) and B (2), f1 only A: f0 is held to 2 by B, f1 takes the other 8.
    np.testing.assert_allclose(sim.max_min_rates([[1, 1], [1, 0]], [10.0, 2.0]), [2.0, 8.0])


def test_three_flow_textbook_case():
    # L0 (cap 1): f0, f1; L1 (cap 2): f0, f2. L0 fills first at 0.5; f2 takes the rest of L1.
    usage = [[1, 1], [1, 0], [0, 1]]
    np.testing.assert_allclose(sim.max_min_rates(usage, [1.0, 2.0]), [0.5, 0.5, 1.5])


def test_aggregated_group_counts_flows_per_link():
    # 4 flows over a class of 2 links: 2 flows per link, 5 each; 10 bytes take 2 s.
    flows = _flows([[1]], [0], [10.0], count=[4])
    for engine in ENGINES:
        np.testing.assert_allclose(engine(_net(10.0, mult=[2]), flows), [2.0])


# --- event-driven completion ---------------------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
def test_completion_frees_bandwidth(engine):
    # Sizes 1 and 3 on a link of 1: both at 0.5 until t=2, then the second alone at 1 -> t=4.
    np.testing.assert_allclose(engine(_net(1.0), _flows([[1]], [0, 0], [1, 3])), [2.0, 4.0])


@pytest.mark.parametrize("engine", ENGINES)
def test_late_start_shares_from_its_start(engine):
    # A (2 B) alone for 1 s; B (0.5 B) joins at t=1, both at 0.5: B done at 2, A (0.5 left) at 2.5.
    flows = _flows([[1]], [0, 0], [2, 0.5], start=[0, 1])
    np.testing.assert_allclose(engine(_net(1.0), flows), [2.5, 2.0])


@pytest.mark.parametrize("engine", ENGINES)
def test_bottleneck_elsewhere_over_time(engine):
    # X (2) carries f0 and f1; Y (0.5) holds f1 at 0.5, so f0 gets 1.5: f0 done at 2/3, f1 at 4.
    flows = _flows([[1, 0], [1, 1]], [0, 1], [1, 2])
    np.testing.assert_allclose(engine(_net(2.0, 0.5), flows), [2 / 3, 4.0])


def test_congestion_scales_capacity_by_overload():
    # 4 flows with floor 5 need 20 on a link of 10: overload 2, exponent 1 -> capacity 5.
    cong = Congestion(exponent=1.0)
    np.testing.assert_allclose(
        cong.capacity(np.array([[4.0]]), np.array([5.0]), np.array([10.0])), [5.0]
    )
    flows = _flows([[1]], [0], [1.0], count=[4], floor=np.array([5.0]))
    for engine in ENGINES:
        np.testing.assert_allclose(engine(_net(10.0), flows, cong), [0.8])  # 1.25 B/s per flow
        np.testing.assert_allclose(engine(_net(10.0), flows), [0.4])  # ideal: 2.5 B/s per flow


# --- one MoE step --------------------------------------------------------------------------------


EXCHANGES = ("hierarchical", "flat")


@pytest.mark.parametrize("exchange", EXCHANGES)
@pytest.mark.parametrize("num_dcs", [2, 4])
def test_ep_matches_analytic_time(num_dcs, exchange):
    # Uplink-bound all-to-all: a DC sends g * D * (N-1)/N bytes out through 1 GB/s (8 Gbps). The
    # hierarchical exchange then forwards inside the DC: each GPU sends (g-1) * D/g through its
    # 16 GB/s (128 Gbps) link.
    c = Datacenters(num_dcs=num_dcs, gpus_per_dc=2, dc_gbps=8.0, exchange=exchange, **BARE)
    a2a = 2 * NO_COMPUTE.data_bytes * (num_dcs - 1) / num_dcs / 1e9
    if exchange == "hierarchical":
        a2a += NO_COMPUTE.data_bytes / 2 / 16e9
    ep = sim.step_time(c, NO_COMPUTE, 1)
    assert ep.dispatch_s == pytest.approx(a2a, rel=1e-12)
    assert ep.total_s == pytest.approx(4 * a2a, rel=1e-12)
    fwd = sim.step_time(c, dataclasses.replace(NO_COMPUTE, forward_only=True), 1)
    assert fwd.total_s == pytest.approx(2 * a2a, rel=1e-12)


@pytest.mark.parametrize("exchange", EXCHANGES)
def test_domain_one_is_plain_ep(exchange):
    c = Datacenters(num_dcs=4, gpus_per_dc=2, exchange=exchange)
    ep = sim.step_time(c, MoELayer(), 1)
    assert ep.allgather_s == 0 and ep.reduce_scatter_s == 0
    # Flat: every other rank; hierarchical: one rank per other DC, then the DC's other GPUs.
    assert ep.peers_per_gpu == (c.num_ranks - 1 if exchange == "flat" else 3 + 1)
    assert ep.wan_bytes_per_gpu == pytest.approx(4 * MoELayer().data_bytes * 3 / 4)
    # Without the reduce-scatter the backward's last all-to-all is the forward's combine.
    assert ep.combine_rs_s == ep.combine_s == ep.dispatch_s


@pytest.mark.parametrize("exchange", EXCHANGES)
def test_domain_of_all_dcs_sends_no_tokens_across_dcs(exchange):
    times = []
    for bw in (0.01, 100.0):
        c = Datacenters(num_dcs=4, gpus_per_dc=2, dc_gbps=bw, exchange=exchange)
        hy = sim.step_time(c, MoELayer(), 4)
        assert hy.peers_per_gpu == c.gpus_per_dc - 1
        assert hy.wan_bytes_per_gpu == pytest.approx(2 * 3 * MoELayer().expert_bytes)
        times.append(hy.dispatch_s)
    assert times[0] == times[1]  # tokens never touch the WAN links


@pytest.mark.parametrize("exchange", EXCHANGES)
@pytest.mark.parametrize("shape", [(4, 2), (2, 3)])
@pytest.mark.parametrize("skew", [0.0, 0.8])
def test_aggregated_equals_every_gpu_flow(shape, skew, exchange):
    # Low bandwidth and a long RTT make the congestion term bind; it must agree too.
    c = Datacenters(
        num_dcs=shape[0],
        gpus_per_dc=shape[1],
        dc_gbps=2e-4,
        wan_latency_s=0.05,
        congestion_exponent=0.3,
        exchange=exchange,
    )
    w = MoELayer(data_bytes=1e6, expert_bytes=1e5, skew=skew)
    assert (
        sim.step_time(c, w, 1).total_s
        != sim.step_time(dataclasses.replace(c, congestion_exponent=0.0), w, 1).total_s
    )
    for s in sim.divisors(c.num_dcs):
        agg = dataclasses.asdict(sim.step_time(c, w, s))
        ref = dataclasses.asdict(sim.step_time(c, w, s, aggregate=False))
        for key, value in agg.items():
            assert value == pytest.approx(ref[key], rel=1e-12), (s, key)


def test_skewed_routing_slows_ep_when_gpu_links_bind():
    c = Datacenters(num_dcs=4, gpus_per_dc=4, dc_gbps=1e4, **BARE)
    uniform = sim.step_time(c, NO_COMPUTE, 1)
    hot = sim.step_time(c, dataclasses.replace(NO_COMPUTE, skew=1.5), 1)
    assert hot.dispatch_s > 1.2 * uniform.dispatch_s


@pytest.mark.parametrize("exchange", EXCHANGES)
def test_large_cluster_runs_aggregated(exchange):
    c = Datacenters(num_dcs=1000, dc_gbps=10.0, exchange=exchange)
    for s in (1, 8):
        t = sim.step_time(c, MoELayer(), s)
        assert t.peers_per_gpu == sum(c.token_messages(s))
        assert t.peers_per_gpu == (c.num_ranks // s - 1 if exchange == "flat" else 1000 // s + 6)
        assert sim.lower_bound(c, MoELayer(), s) <= t.total_s


@pytest.mark.parametrize(
    "num_dcs,gpus,domain,dc_gbps",
    [(4, 2, 1, 1.0), (4, 2, 2, 1.0), (6, 4, 3, 40.0), (8, 3, 1, 500.0)],
)
def test_hierarchical_exchange_equals_the_cost_model(num_dcs, gpus, domain, dc_gbps):
    # Two independent models of this runtime, one by flows (sim) and one closed form (xdc), agree
    # where both apply: no latency, per-message cost or congestion; uniform top-1 routing (no
    # copies to deduplicate). A token exchange is the DC level, then the GPU level; the gather is
    # one WAN transfer. Both are bound by the GPU's PCIe link or the DC's shared uplink.
    c = Datacenters(num_dcs=num_dcs, gpus_per_dc=gpus, dc_gbps=dc_gbps, **BARE)
    w = MoELayer(data_bytes=3000 * 1024 * 2, expert_bytes=3e5, compute_s=0.0, pre_expert_s=0.0)
    t = sim.step_time(c, w, domain)
    # The cost model as the planned policy builds it for this cluster (levels dc, local).
    plan = sim.policies.plan(c, w)
    levels = next(x for x in plan.candidates if x.domains == (domain, 1)).cost.levels
    assert t.dispatch_s == pytest.approx(sum(level.tokens for level in levels), rel=1e-12)
    assert t.allgather_s == pytest.approx(levels[0].gather, rel=1e-12)
    assert levels[1].gather == 0


# --- policies ------------------------------------------------------------------------------------


def test_domain_policies():
    assert sim.fixed_domain(1000, 8) == 8
    assert sim.fixed_domain(12, 8) == 6
    assert sim.fixed_domain(2, 8) == 2
    assert sim.fixed_fraction(1000, 0.5) == 500
    assert sim.fixed_fraction(1024, 0.9) == 128  # target 102.4: 128 is nearer than 64
    assert sim.fixed_fraction(8, 0.9) == 1
    with pytest.raises(ValueError, match="p must be"):
        sim.fixed_fraction(8, 1.5)
    with pytest.raises(ValueError, match="must divide"):
        sim.step_time(Datacenters(num_dcs=6), MoELayer(), 4)
    with pytest.raises(ValueError, match="exchange must be one of"):
        Datacenters(num_dcs=2, exchange="ring")


@pytest.mark.parametrize("exchange", EXCHANGES)
@pytest.mark.parametrize("bw", [1.0, 100.0])
def test_best_domain_is_the_minimum_over_divisors(bw, exchange):
    c = Datacenters(num_dcs=12, dc_gbps=bw, exchange=exchange)
    times = {s: sim.step_time(c, MoELayer(), s).total_s for s in sim.divisors(12)}
    for s, t in times.items():
        assert sim.lower_bound(c, MoELayer(), s) <= t
    assert sim.best_domain(c, MoELayer()).total_s == min(times.values())


@pytest.mark.parametrize(
    "num_dcs,gpus,dc_gbps,expert_mb,pre_ms",
    [
        (12, 2, 1.0, 0.3, 0.0),
        (12, 2, 1.0, 3.0, 0.0),
        (12, 4, 10.0, 1.0, 2.0),
        (12, 2, 1.0, 2.0, 30.0),
        (16, 8, 1.0, 0.4, 50.0),
    ],
)
def test_planned_domain_is_the_cost_models_choice(num_dcs, gpus, dc_gbps, expert_mb, pre_ms):
    # Forward only, without latency, per-message cost, congestion or compute, the simulator and
    # the cost model time every candidate alike (the model hides the gather under the pre-expert
    # compute and counts the rest), so the plan is the simulator's best domain: S = N, 1 and 2
    # among these cases.
    c = Datacenters(num_dcs=num_dcs, gpus_per_dc=gpus, dc_gbps=dc_gbps, **BARE)
    w = MoELayer(
        data_bytes=2048 * 3000,
        expert_bytes=expert_mb * 1e6,
        compute_s=0.0,
        pre_expert_s=pre_ms * 1e-3,
        forward_only=True,
    )
    plan = sim.policies.plan(c, w)
    for candidate in plan.candidates:
        simulated = sim.step_time(c, w, candidate.domains[0]).total_s - w.pre_expert_s
        assert candidate.comm_time == pytest.approx(simulated, rel=1e-12), candidate.domains
    assert sim.planned_domain(c, w) == sim.best_domain(c, w).domain


# --- trends (the paper's: N = 128 at defaults, N = 1000; docs/crossdc_simulator.md) -------------


def test_trends_lower_bandwidth_larger_gain_and_fixed_p_above_fixed_domain():
    rows = sim.run_sweep(
        Datacenters(num_dcs=1), MoELayer(), dc_counts=(128,), domains=(8,), fractions=(0.5,)
    )
    gain = {(r["policy"], r["dc_gbps"]): r["speedup"] for r in rows}
    for policy in ("fixed_domain", "fixed_p", "best"):
        series = [gain[(policy, bw)] for bw in BANDWIDTHS_GBPS]
        assert all(a > b for a, b in zip(series, series[1:], strict=False)), (policy, series)
    for bw in BANDWIDTHS_GBPS:
        assert gain[("fixed_p", bw)] >= gain[("fixed_domain", bw)]


def test_trends_at_1000_dcs():
    # The paper's 1000-DC trends: with small per-GPU experts (36 KB; the regime its fixed-p gains
    # imply) every policy gains more at lower bandwidth and fixed p >= fixed domain; with the
    # Table V experts (0.36 MB) the best domain (best S) still never gains more as bandwidth
    # rises. Flat exchanges break the first at 100 Gbps (docs/crossdc_simulator.md, §3).
    rows = sim.run_sweep(
        Datacenters(num_dcs=1),
        MoELayer(expert_bytes=36e3),
        dc_counts=(1000,),
        domains=(2, 8),
        fractions=(0.5, 0.9),
    )
    gain = {(r["policy"], r["param"], r["dc_gbps"]): r["speedup"] for r in rows}
    for policy, param in {(r["policy"], r["param"]) for r in rows}:
        series = [gain[(policy, param, bw)] for bw in BANDWIDTHS_GBPS]
        assert all(a > b for a, b in zip(series, series[1:], strict=False)), (policy, series)
    for bw in BANDWIDTHS_GBPS:
        assert min(gain[("fixed_p", p, bw)] for p in (0.5, 0.9)) >= gain[("fixed_domain", 8, bw)]
    rows = sim.run_sweep(
        Datacenters(num_dcs=1),
        MoELayer(),
        dc_counts=(1000,),
        domains=(),
        fractions=(),
        planned=False,
    )
    series = [r["speedup"] for r in rows]
    assert series[0] > 1.2 and all(a >= b for a, b in zip(series, series[1:], strict=False))


def test_byte_counting_gives_no_fixed_domain_gain_at_scale():
    # Without per-message costs or congestion a domain of 2 among 128 DCs saves 1/128 of the
    # token bytes and adds the expert traffic: about 1x, as the paper's byte model says.
    c = Datacenters(num_dcs=128, dc_gbps=0.1, msg_overhead_s=0.0, congestion_exponent=0.0)
    gain = sim.step_time(c, MoELayer(), 1).total_s / sim.step_time(c, MoELayer(), 2).total_s
    assert 0.95 < gain < 1.05


# --- CLI -----------------------------------------------------------------------------------------


def test_cli_writes_csv_and_png(tmp_path, capsys):
    csv, png = tmp_path / "s.csv", tmp_path / "s.png"
    rows = main(
        ["--dcs", "2", "4", "--bandwidths", "10", "--csv", str(csv), "--png", str(png), "--quiet"]
    )
    assert len(rows) == 2 * (3 + 2 + 1 + 1)
    back = sim.read_csv(str(csv))
    assert [r["speedup"] for r in back] == pytest.approx([r["speedup"] for r in rows], rel=1e-5)
    assert png.stat().st_size > 10_000
    assert "4 DCs x 8 GPUs" in capsys.readouterr().out
    assert "--congestion" in parser().format_help()


# --- SR compression ------------------------------------------------------------------------------


def test_compression_shrinks_the_gather_and_adds_the_shared_sync():
    c = Datacenters(num_dcs=4, gpus_per_dc=2, dc_gbps=8.0, **BARE)
    full = sim.step_time(c, NO_COMPUTE, 4)
    sr = sim.step_time(c, dataclasses.replace(NO_COMPUTE, compression=10.0), 4)
    both = sim.step_time(
        c, dataclasses.replace(NO_COMPUTE, compression=10.0, compress_gradients=True), 4
    )
    p_e = NO_COMPUTE.expert_bytes
    # Pure bandwidth: the same flows with a tenth of the bytes take a tenth of the time.
    assert sr.allgather_s == pytest.approx(full.allgather_s / 10, rel=1e-12)
    assert full.shared_sync_s == 0 < sr.shared_sync_s
    # Wire bytes: gather P_E / 10, shared sync 2 (S - 1) P_E / S, reduce-scatter full size
    # unless the gradients are compressed too.
    assert sr.wan_bytes_per_gpu == pytest.approx(3 * p_e / 10 + 2 * 3 * p_e / 4 + 3 * p_e)
    assert both.wan_bytes_per_gpu == pytest.approx(3 * p_e / 10 + 2 * 3 * p_e / 4 + 3 * p_e / 10)
    assert both.reduce_scatter_s < sr.reduce_scatter_s == pytest.approx(full.reduce_scatter_s)
    plain = sim.step_time(c, dataclasses.replace(NO_COMPUTE, compression=10.0), 1)
    assert plain.total_s == sim.step_time(c, NO_COMPUTE, 1).total_s  # nothing to compress


def test_compressed_step_aggregated_equals_every_gpu_flow_and_stays_above_its_bound():
    c = Datacenters(
        num_dcs=4, gpus_per_dc=2, dc_gbps=2e-4, wan_latency_s=0.05, congestion_exponent=0.3
    )
    w = MoELayer(
        data_bytes=1e6, expert_bytes=1e5, skew=0.8, compression=4.0, compress_gradients=True
    )
    for s in (2, 4):
        agg = dataclasses.asdict(sim.step_time(c, w, s))
        ref = dataclasses.asdict(sim.step_time(c, w, s, aggregate=False))
        for key, value in agg.items():
            assert value == pytest.approx(ref[key], rel=1e-12), (s, key)
        assert sim.lower_bound(c, w, s) <= agg["total_s"]


def test_phase_kinds():
    assert {p for p in sim.Phase if p.rail} == {sim.Phase.GATHER, sim.Phase.SCATTER, sim.Phase.SYNC}
    assert {p for p in sim.Phase if p.local} == {sim.Phase.LOCAL_DISPATCH, sim.Phase.LOCAL_COMBINE}
    assert {p for p in sim.Phase if p.transposed} == {sim.Phase.COMBINE, sim.Phase.LOCAL_COMBINE}
    assert [p for p in sim.Phase if p.tag != sim.cluster.TOKENS] == [sim.Phase.SCATTER]


# --- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: Datacenters(num_dcs=0), "Datacenters.num_dcs must be an int >= 1, got 0"),
        (lambda: Datacenters(num_dcs=2, dc_gbps=float("nan")), "dc_gbps must be a finite"),
        (lambda: Datacenters(num_dcs=2, wan_latency_s=-1), "wan_latency_s must be a finite"),
        (lambda: MoELayer(compression=0.5), "MoELayer.compression must be a finite number >= 1"),
        (lambda: MoELayer(data_bytes=-1), "MoELayer.data_bytes must be a finite number >= 0"),
        (lambda: sim.step_time(Datacenters(num_dcs=4), MoELayer(), 2.0), "domain size 2.0"),
    ],
)
def test_constructors_name_the_bad_value(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--bandwidths", "-1"], "--bandwidths: every value must be > 0, got \\[-1.0\\]"),
        (["--dcs", "0"], "--dcs: every value must be >= 1"),
        (["--p", "1.5"], "--p: every value must be in \\[0, 1\\]"),
        (["--gpu-gbps", "0"], "--gpu-gbps: Datacenters.gpu_gbps must be"),
        (["--compression", "0.5"], "--compression: MoELayer.compression must be"),
    ],
)
def test_cli_names_the_bad_flag(argv, message):
    with pytest.raises(ValueError, match=message):
        main(argv + ["--csv", "", "--png", "", "--quiet"])


def test_sensitivity_varies_one_constant_at_a_time():
    from jax_hybridep.sim import sensitivity

    rows = sensitivity.sensitivity(
        Datacenters(num_dcs=1),
        MoELayer(expert_bytes=36e3),
        constants={"congestion_exponent": (0.0, 0.3), "msg_overhead_s": (5e-6,)},
        bandwidths=(0.01,),
        num_dcs=8,
        domain=2,
        fraction=0.5,
    )
    assert len(rows) == 3 * 3 and {r["policy"] for r in rows} == {"fixed_domain", "fixed_p", "best"}
    ep = {(r["constant"], r["value"]): r["ep_s"] for r in rows}
    # Congestion binds at 0.01 Gbps (8 x 7 flows per uplink), so the exponent matters.
    assert ep["congestion_exponent", 0.3] > ep["congestion_exponent", 0.0]
    with pytest.raises(ValueError, match="not Datacenters fields"):
        sensitivity.sensitivity(Datacenters(num_dcs=1), MoELayer(), constants={"beta": (0,)})
    with pytest.raises(ValueError, match="--dcs=0"):
        sensitivity.main(["--dcs", "0", "--csv", ""])
