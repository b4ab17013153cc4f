"""Time of one MoE layer step across datacenters: plain EP vs. HybridEP (`step_time`).

The cluster and the layer are `cluster.Datacenters` and `cluster.MoELayer`; the messages of each
phase come from `messages`, the rates and completion times from `network` (max-min fair,
event-driven; DC links whose flows' floor rates exceed their capacity lose goodput,
`network.Congestion`).

HybridEP with domain size S (at the DC level, S | num_dcs). Forward: with SR compression the
shared expert's all-reduce (a reduce-scatter, then an all-gather, within the domain), then the
expert all-gather ((S-1) experts in, compressed when `compression` > 1), both from step begin and
hidden under the pre-expert compute `pre_expert_s`; then the token dispatch and combine. Backward:
the two transposed exchanges, and the reduce-scatter of replica gradients ((S-1) experts out, full
size unless `compress_gradients`) concurrent with the last one, hidden under the backward
pre-expert compute. S = 1 is plain EP.
"""

from __future__ import annotations

import dataclasses

from jax_hybridep.sim import messages
from jax_hybridep.sim.cluster import GRADS, TOKENS, Datacenters, MoELayer, Phase
from jax_hybridep.sim.network import phase_end, simulate, simulate_reference
from jax_hybridep.values import check_bool, check_type


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Simulated time of one layer step (seconds) and its parts."""

    domain: int
    total_s: float
    allgather_s: float  # forward expert all-gather, after the shared sync (overlaps pre_expert_s)
    dispatch_s: float  # one token all-to-all, dispatch pattern (forward, and backward combine^T)
    combine_s: float  # combine pattern, alone (forward)
    combine_rs_s: float  # combine pattern concurrent with the reduce-scatter (backward)
    reduce_scatter_s: float  # end of the gradient reduce-scatter in that backward phase
    compute_s: float  # compute in the step (pre-expert and the rest, backward 2x)
    wan_bytes_per_gpu: float  # cross-DC bytes a GPU sends in the step, headers included
    peers_per_gpu: int  # messages a rank sends in one token exchange (both stages)
    shared_sync_s: float = 0.0  # the shared expert's all-reduce (SR compression), forward


def _phase(
    c: Datacenters, w: MoELayer, domain: int, phases: tuple[Phase, ...], aggregate: bool
) -> dict[int, float]:
    """Simulate the messages of `phases` started together; end time per tag."""
    built = (messages.aggregated if aggregate else messages.explicit)(c, w, domain, phases)
    if built is None:
        return {}
    net, flows = built
    engine = simulate if aggregate else simulate_reference
    finish = engine(net, flows, c.congestion)
    return {int(t): phase_end(flows, finish, int(t)) for t in set(flows.tag.tolist())}


def _exchange(
    c: Datacenters, w: MoELayer, domain: int, combine: bool, aggregate: bool, scatter: bool = False
) -> tuple[float, float]:
    """One token exchange, dispatch or combine pattern: (tokens end, reduce-scatter end).

    `scatter` runs the reduce-scatter concurrently, from the start of the exchange's cross-DC
    messages (flat: the whole exchange; hierarchical: its WAN stage, after the local one)."""
    extra = (Phase.SCATTER,) if scatter and domain > 1 else ()
    if not c.hierarchical:
        tokens = Phase.COMBINE if combine else Phase.DISPATCH
        ends = _phase(c, w, domain, (tokens, *extra), aggregate)
        return ends.get(TOKENS, 0.0), ends.get(GRADS, 0.0)
    # The stages run one after the other; the WAN stage is the same traffic in both directions.
    local = Phase.LOCAL_COMBINE if combine else Phase.LOCAL_DISPATCH
    local_s = _phase(c, w, domain, (local,), aggregate).get(TOKENS, 0.0)
    ends = _phase(c, w, domain, (Phase.WAN, *extra), aggregate)
    scatter_end = local_s + ends[GRADS] if GRADS in ends else 0.0
    return local_s + ends.get(TOKENS, 0.0), scatter_end


def check_inputs(c, w, names: tuple[str, str] = ("c", "w")) -> None:
    """TypeError unless c is a Datacenters and w a MoELayer (the arguments `names`)."""
    check_type(names[0], c, Datacenters, "a sim.Datacenters")
    check_type(names[1], w, MoELayer, "a sim.MoELayer")


def step_time(c: Datacenters, w: MoELayer, domain: int = 1, *, aggregate: bool = True) -> StepTime:
    """Simulated time of one MoE layer step with DC-level expert domain `domain` (1 = plain EP).

    Args:
      c: the datacenters.
      w: the layer.
      domain: S, DCs per expert domain; must divide `c.num_dcs`.
      aggregate: False simulates every GPU flow on every physical link (small clusters only).
    """
    check_inputs(c, w)
    domain = c.check_domain(domain)
    check_bool("aggregate", aggregate)
    sync = fwd_ag = 0.0
    if domain > 1:
        if w.compressed:  # the shared expert: a reduce-scatter, then an all-gather, alike
            sync = 2 * _phase(c, w, domain, (Phase.SYNC,), aggregate).get(TOKENS, 0.0)
        fwd_ag = _phase(c, w, domain, (Phase.GATHER,), aggregate).get(TOKENS, 0.0)
    dispatch = _exchange(c, w, domain, False, aggregate)[0]
    # Uniform routing makes combine the same traffic as dispatch (hierarchical: in reverse).
    combine = dispatch if w.skew == 0 else _exchange(c, w, domain, True, aggregate)[0]
    fwd = max(w.pre_expert_s, sync + fwd_ag) + dispatch + combine + w.compute_s
    m = c.num_dcs // domain
    cross_msgs, local_msgs = c.token_messages(domain)
    wan = w.data_bytes * (m - 1) / m + cross_msgs * c.header_bytes
    ag_wan = (domain - 1) * (w.gather_bytes + c.header_bytes)
    if sync:
        ag_wan += 2 * (domain - 1) * (w.expert_bytes / domain + c.header_bytes)
    peers = cross_msgs + local_msgs
    if w.forward_only:
        return StepTime(
            domain,
            fwd,
            fwd_ag,
            dispatch,
            combine,
            0.0,
            0.0,
            w.pre_expert_s + w.compute_s,
            2 * wan + ag_wan,
            peers,
            sync,
        )
    comb_rs, rs = _exchange(c, w, domain, True, aggregate, scatter=True)
    rs_wan = (domain - 1) * (w.scatter_bytes + c.header_bytes)
    # Backward: combine^T (dispatch pattern), expert backward, dispatch^T (combine pattern) with
    # the reduce-scatter, then pre-expert backward (2x forward) that the reduce-scatter can hide
    # under.
    bwd = dispatch + 2 * w.compute_s + max(comb_rs + 2 * w.pre_expert_s, rs)
    return StepTime(
        domain,
        fwd + bwd,
        fwd_ag,
        dispatch,
        combine,
        comb_rs,
        rs,
        3 * (w.pre_expert_s + w.compute_s),
        4 * wan + (ag_wan + rs_wan),
        peers,
        sync,
    )
