"""Domain-size policies (fixed domain, fixed p, best S, the cost model's plan) and a lower bound
that prunes best S."""

from __future__ import annotations

from jax_hybridep.sim.cluster import Datacenters, MoELayer
from jax_hybridep.sim.moe_step import StepTime, check_inputs, step_time
from jax_hybridep.values import check_int, check_real
from jax_hybridep.xdc.migration import Migration
from jax_hybridep.xdc.model import cost, planner


def lower_bound(c: Datacenters, w: MoELayer, domain: int) -> float:
    """A bound below `step_time(c, w, domain).total_s`: each phase needs at least its DC
    uplink bytes at full rate, and at least the posting time plus latency of its last message
    (a hierarchical exchange: of each of its two stages)."""
    check_inputs(c, w)
    c.check_domain(domain)
    m, g, up = c.num_dcs // domain, c.gpus_per_dc, c.dc_gbps * 1e9 / 8
    cross, local = c.token_messages(domain)
    uplink = g * (w.data_bytes * (m - 1) / m + cross * c.header_bytes) / up
    if c.hierarchical:
        wan = (cross - 1) * c.msg_overhead_s + c.wan_latency_s if cross else 0.0
        intra = (local - 1) * c.msg_overhead_s + c.intra_latency_s if local else 0.0
        a2a = max(uplink, wan) + intra
    else:
        peers = cross + local
        lat = c.wan_latency_s if m > 1 else c.intra_latency_s
        a2a = max(uplink, (peers - 1) * c.msg_overhead_s + lat if peers else 0.0)
    ag = rs = 0.0
    if domain > 1:
        posting = (domain - 2) * c.msg_overhead_s + c.wan_latency_s
        ag = max(g * (domain - 1) * (w.gather_bytes + c.header_bytes) / up, posting)
        rs = max(g * (domain - 1) * (w.scatter_bytes + c.header_bytes) / up, posting)
    fwd = max(w.pre_expert_s, ag) + 2 * a2a + w.compute_s
    if w.forward_only:
        return fwd
    return fwd + a2a + 2 * w.compute_s + max(a2a + 2 * w.pre_expert_s, rs)


def fixed_domain(num_dcs: int, size: int) -> int:
    """Policy "fixed domain": the largest divisor of num_dcs not above `size` (>= 1)."""
    check_int("num_dcs", num_dcs, 1)
    check_int("size", size, 1)
    return max(s for s in cost.divisors(num_dcs) if s <= size)


def fixed_fraction(num_dcs: int, p: float) -> int:
    """Policy "fixed p": the divisor of num_dcs nearest num_dcs * (1 - p), so that a fraction p
    of the cross-DC token traffic remains (1 - S/N = p); ties go to the smaller domain."""
    check_real("p", p, 0.0, 1.0)
    check_int("num_dcs", num_dcs, 1)
    target = num_dcs * (1 - p)
    return min(cost.divisors(num_dcs), key=lambda s: (abs(s - target), s))


def best_domain(c: Datacenters, w: MoELayer, step=step_time) -> StepTime:
    """Policy "best S": the fastest step over all divisors of the DC count.

    Domains are tried in order of `lower_bound`; a domain whose bound is no better than the best
    simulated time cannot win and is skipped, so the result equals the full minimum.

    Args:
      c: the datacenters.
      w: the layer.
      step: `step_time` or a caching stand-in with its signature.
    """
    check_inputs(c, w)
    if not callable(step):
        raise TypeError(f"step must be step_time or a callable like it, got {step!r}")
    best = None
    for s in sorted(cost.divisors(c.num_dcs), key=lambda s: lower_bound(c, w, s)):
        if best is not None and lower_bound(c, w, s) >= best.total_s:
            break
        t = step(c, w, s)
        if best is None or t.total_s < best.total_s:
            best = t
    return best


# How the cost model sees a simulated workload: top-1 tokens of H x 2 bytes (for uniform top-1
# routing the volumes depend on D only, not on how it splits into tokens), one expert per rank.
_HIDDEN, _ACT_BYTES = 1024, 2


def planned_domain(c: Datacenters, w: MoELayer) -> int:
    """Policy "planned": the DC-level domain that `xdc.plan` (the closed-form cost model this
    package's planner uses) picks for the same cluster, intra-DC domain 1 as in the simulator."""
    return plan(c, w).domains[0]


def plan(c: Datacenters, w: MoELayer) -> planner.Plan:
    """`xdc.plan` over the domains (S, 1), S | num_dcs, for a simulated cluster and workload.

    The model sees each GPU's link (rate `gpu_gbps`) at both levels, the DC link as the uplink the
    DC's GPUs share, and `msg_overhead_s` per message, added up; it has no one-way latency and
    no congestion, and it hides only the forward gather (under `pre_expert_s`). It models this
    package's runtime, so its exchange is hierarchical whichever `c.exchange` is simulated, and
    its gradients are exact (`compress_gradients` is not modelled).
    """
    check_inputs(c, w)
    gpu, dc = c.gpu_gbps * 1e9 / 8, c.dc_gbps * 1e9 / 8
    model = cost.Cluster(
        (c.num_dcs, c.gpus_per_dc),
        (cost.Link(gpu, c.msg_overhead_s, uplink=dc), cost.Link(gpu, c.msg_overhead_s)),
        ("dc", "local"),
    )
    load = planner.Workload(
        tokens=max(1, round(w.data_bytes / (_HIDDEN * _ACT_BYTES))),
        top_k=1,
        num_experts=c.num_ranks,
        hidden=_HIDDEN,
        act_bytes=_ACT_BYTES,
        expert_bytes=round(w.expert_bytes),
        # The simulator's SR: a mean shared expert synced every step.
        migration=Migration(compression=w.compression if w.compressed else None, shared="mean"),
        training=not w.forward_only,
        lat_pe=w.pre_expert_s,
    )
    return planner.plan(model, load, candidates=[(s, 1) for s in cost.divisors(c.num_dcs)])
