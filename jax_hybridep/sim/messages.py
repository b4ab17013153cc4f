"""Traffic and time of one MoE layer step across datacenters: plain EP vs. HybridEP.

Cluster: `num_dcs` DCs x `gpus_per_dc` GPUs; rank (d, i) is GPU i of DC d. Links (each direction
its own link): one per GPU to its DC fabric (`gpu_gbps`, PCIe/NVLink class), one uplink and one
downlink per DC (`dc_gbps`, shared by the DC's GPUs); the WAN core between DCs is non-blocking, so
only up- and downlinks contend. Intra-DC messages cross the two GPU links; cross-DC messages cross
GPU up, DC up, DC down, GPU down.

Messages: a rank posts its messages one after the other, `msg_overhead_s` apart (CPU/NIC cost per
message), in rotated order (nearest peer offset first); a message's bytes start `latency` after it
is posted (one-way WAN or intra-DC latency) and carry `header_bytes` on top of the payload.
Rates are max-min fair; DC links whose flows' floor rates (min window / RTT) exceed their capacity
lose goodput (`network.Congestion`, exponent `congestion_exponent`).

Token exchanges (`Cluster.exchange`): "hierarchical" (default; this package's runtime, and
DeepEP / Hybrid-EP internode dispatch) sends one cross-DC message per destination DC, to the
rank with the sender's GPU index, carrying the tokens of all that DC's GPUs; a second stage
forwards them inside the DC (dispatch: WAN then local; combine: local then WAN). "flat" (Tutel's
all-to-all) sends every rank's tokens to every peer rank directly.

HybridEP with domain size S (at the DC level, S | num_dcs): DC d = o*S + s belongs to domain o
at offset s. Forward: each rank all-gathers the experts of the ranks with the same GPU index in
the other S-1 DCs of its domain ((S-1) * expert_bytes in), starting at step begin, hidden under
the pre-expert compute `pre_expert_s`; a token for an expert at (d', j) goes to the replica at
(d'', j) where d'' is in the domain of d' at offset s, so the token all-to-all runs among the
G/S ranks whose DC has the rank's offset (cross-DC between domains, plus intra-DC). Backward:
the two transposed all-to-alls, and the reduce-scatter of replica gradients ((S-1) *
expert_bytes out, the all-gather's pattern) concurrent with the last one, hidden under the
backward pre-expert compute. S = 1 is plain EP.

Routing is uniform, or skewed by a Zipf exponent over the GPU index of the destination (the same
in every DC, so the traffic keeps its rotation symmetry over DCs and stays aggregated).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jax_hybridep.sim.network import (
    Congestion,
    Flows,
    Network,
    phase_end,
    simulate,
    simulate_reference,
)

TOKENS, GRADS = 0, 1  # Flows.tag values
EXCHANGES = ("hierarchical", "flat")


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Datacenters, links and per-message costs.

    Attributes:
      num_dcs: N, datacenters.
      gpus_per_dc: g, GPUs (ranks) per DC.
      dc_gbps: each DC's uplink and downlink (each direction), Gbit/s, shared by its g GPUs.
      gpu_gbps: each GPU's link to its DC (PCIe 3.0 x16 class in the paper's testbed), Gbit/s.
      wan_latency_s: one-way latency a cross-DC message pays before its bytes flow (RTT/2).
      intra_latency_s: the same inside a DC.
      msg_overhead_s: o, sender cost per message; a rank's messages start o apart.
      header_bytes: bytes added to every message.
      min_window_bytes: a flow's minimum window; min window / RTT is its floor rate.
      congestion_exponent: `Congestion.exponent` on the DC links (0: ideal max-min sharing).
      exchange: "hierarchical" (cross-DC to the same GPU index, then forwarded inside the DC) or
        "flat" (every rank to every peer rank directly).
    """

    num_dcs: int
    gpus_per_dc: int = 8
    dc_gbps: float = 10.0
    gpu_gbps: float = 128.0
    wan_latency_s: float = 5e-3
    intra_latency_s: float = 5e-6
    msg_overhead_s: float = 5e-6
    header_bytes: float = 0.0
    min_window_bytes: float = 1500.0
    congestion_exponent: float = 0.1
    exchange: str = "hierarchical"

    def __post_init__(self):
        if self.num_dcs < 1 or self.gpus_per_dc < 1:
            raise ValueError(f"need >= 1 DC and GPU, got {self.num_dcs} x {self.gpus_per_dc}")
        if self.dc_gbps <= 0 or self.gpu_gbps <= 0:
            raise ValueError(f"bandwidths must be > 0, got dc {self.dc_gbps}, gpu {self.gpu_gbps}")
        costs = (
            self.wan_latency_s,
            self.intra_latency_s,
            self.msg_overhead_s,
            self.header_bytes,
            self.min_window_bytes,
            self.congestion_exponent,
        )
        if min(costs) < 0:
            raise ValueError(f"latencies, overheads, window and exponent must be >= 0: {self}")
        if self.exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {EXCHANGES}, got {self.exchange!r}")

    @property
    def num_ranks(self) -> int:
        return self.num_dcs * self.gpus_per_dc

    def floor(self, cross: np.ndarray) -> np.ndarray:
        """Per-flow floor rate (min window / RTT) of intra-DC (False) or cross-DC (True) flows."""
        rtt = 2 * np.where(cross, self.wan_latency_s, self.intra_latency_s)
        return np.where(rtt > 0, self.min_window_bytes / np.maximum(rtt, 1e-300), 0.0)

    @property
    def congestion(self) -> Congestion:
        return Congestion(self.congestion_exponent)

    @property
    def hierarchical(self) -> bool:
        return self.exchange == "hierarchical"

    def token_messages(self, domain: int) -> tuple[int, int]:
        """(cross-DC, intra-DC) messages a rank sends in one token exchange with domain S."""
        m, g = self.num_dcs // domain, self.gpus_per_dc
        return (m - 1, g - 1) if self.hierarchical else ((m - 1) * g, g - 1)

    def scatter_slot(self, domain: int) -> int:
        """Posting slot of a rank's first reduce-scatter message: after its token messages of
        the phase the reduce-scatter joins (hierarchical: the WAN stage; flat: all of them)."""
        cross, local = self.token_messages(domain)
        return cross if self.hierarchical else cross + local


@dataclasses.dataclass(frozen=True)
class Workload:
    """One MoE layer's sizes and compute (backward compute is twice the forward's).

    Attributes:
      data_bytes: D, bytes a rank feeds into one token all-to-all.
      expert_bytes: P_E, expert bytes a rank holds (all-gathered / reduce-scattered in a domain).
      compute_s: forward compute that overlaps no communication (experts, post-expert work).
      pre_expert_s: Lat_PE, forward pre-expert compute that the expert all-gather can hide under.
      skew: Zipf exponent of routing over the destination GPU index (0: uniform).
      forward_only: time the forward pass only.
    """

    data_bytes: float = 48e6
    expert_bytes: float = 0.36e6
    compute_s: float = 10e-3
    pre_expert_s: float = 5e-3
    skew: float = 0.0
    forward_only: bool = False

    def __post_init__(self):
        sizes = (self.data_bytes, self.expert_bytes, self.compute_s, self.pre_expert_s, self.skew)
        if min(sizes) < 0:
            raise ValueError(f"workload sizes must be >= 0, got {self}")


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Simulated time of one layer step (seconds) and its parts."""

    domain: int
    total_s: float
    allgather_s: float  # forward expert all-gather (overlaps pre_expert_s)
    dispatch_s: float  # one token all-to-all, dispatch pattern (forward, and backward combine^T)
    combine_s: float  # combine pattern, alone (forward)
    combine_rs_s: float  # combine pattern concurrent with the reduce-scatter (backward)
    reduce_scatter_s: float  # end of the gradient reduce-scatter in that backward phase
    compute_s: float  # compute in the step (pre-expert and the rest, backward 2x)
    wan_bytes_per_gpu: float  # cross-DC bytes a GPU sends in the step, headers included
    peers_per_gpu: int  # messages a rank sends in one token exchange (both stages)


def _weights(g: int, skew: float) -> np.ndarray:
    w = (1.0 + np.arange(g)) ** -skew
    return w * g / w.sum()  # mean 1: a rank still feeds D bytes in all


def _network(c: Cluster, per_index: bool) -> Network:
    """Aggregated link classes; per GPU index when routing is skewed by GPU index."""
    n, g = c.num_dcs, c.gpus_per_dc
    gpu, dc = c.gpu_gbps * 1e9 / 8, c.dc_gbps * 1e9 / 8
    k = g if per_index else 1
    names = [f"gpu_up{i}" for i in range(k)] + [f"gpu_down{i}" for i in range(k)]
    mult = n if per_index else n * g
    return Network(
        capacity=np.array([gpu] * 2 * k + [dc, dc]),
        multiplicity=np.array([mult] * 2 * k + [n, n]),
        names=(*names, "dc_up", "dc_down"),
        congestible=np.array([False] * 2 * k + [True, True]),
    )


def _paths(g: int, per_index: bool) -> np.ndarray:
    """Path classes (cross, i, j) -> row (cross * k + i) * k + j; k = g, or 1 if aggregated."""
    k = g if per_index else 1
    paths = np.zeros((2 * k * k, 2 * k + 2), dtype=bool)
    for cross in (0, 1):
        for i in range(k):
            for j in range(k):
                row = paths[(cross * k + i) * k + j]
                row[i] = row[k + j] = True
                row[2 * k :] = bool(cross)
    return paths


def _flows(c: Cluster, per_index: bool, parts: list[dict]) -> Flows:
    """Aggregated groups from message parts: dict of arrays src, dst, cross, size, slot, count."""
    k = c.gpus_per_dc if per_index else 1
    cat = {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}
    cross = cat["cross"].astype(int)
    src, dst = (cat["src"], cat["dst"]) if per_index else (0 * cross, 0 * cross)
    latency = np.where(cross == 1, c.wan_latency_s, c.intra_latency_s)
    paths = _paths(c.gpus_per_dc, per_index)
    return Flows(
        paths=paths,
        floor=c.floor(paths[:, -1]),
        path=(cross * k + src) * k + dst,
        count=cat["count"].astype(np.float64),
        size=cat["size"] + c.header_bytes,
        start=cat["slot"] * c.msg_overhead_s + latency,
        tag=cat["tag"],
    )


def _groups(c: Cluster, per_index: bool, src, dst, cross, size, slot, tag: int) -> dict:
    """Message groups as arrays (a group: one message from every rank, or from every rank with
    GPU index `src` when routing is skewed by GPU index); scalars are broadcast."""
    shape = np.shape(src)
    return dict(
        src=src,
        dst=dst,
        cross=np.broadcast_to(cross, shape),
        size=np.broadcast_to(np.asarray(size, np.float64), shape),
        slot=np.asarray(slot, np.float64),
        count=np.full(shape, c.num_dcs if per_index else c.num_ranks),
        tag=np.full(shape, tag),
    )


def _token_part(c: Cluster, w: Workload, domain: int, transpose: bool, per_index: bool) -> dict:
    """Token all-to-all among the G/S ranks at one domain offset: groups (m, i, e) -> rank (d, i)
    sends to (d + m*S, i + e); m > 0 crosses DCs. Dispatch bytes follow the destination's weight,
    combine (its transpose) the sender's."""
    n, g = c.num_dcs, c.gpus_per_dc
    m, i, e = np.meshgrid(
        np.arange(n // domain), np.arange(g if per_index else 1), np.arange(g), indexing="ij"
    )
    m, i, e = m.ravel(), i.ravel(), e.ravel()
    keep = (m > 0) | (e > 0)
    m, i, e = m[keep], i[keep], e[keep]
    j = (i + e) % g
    size = w.data_bytes * domain / c.num_ranks * _weights(g, w.skew)[i if transpose else j]
    return _groups(c, per_index, i, j, m > 0, size, m * g + e - 1, TOKENS)


def _rail_part(
    c: Cluster, per_index: bool, messages: int, size: float, first_slot: int, tag: int
) -> dict:
    """Rank (d, i) sends `size` bytes to the rank with its GPU index in each of `messages` other
    DCs, posted from `first_slot` on: groups (m, i). The hierarchical exchange's WAN stage (one
    message per DC of the token group, the tokens of all its g GPUs; the weights average 1, so
    skew leaves it uniform), the expert all-gather and its transpose, the reduce-scatter (one
    message per other DC of the domain)."""
    m, i = np.meshgrid(
        np.arange(1, messages + 1), np.arange(c.gpus_per_dc if per_index else 1), indexing="ij"
    )
    m, i = m.ravel(), i.ravel()
    return _groups(c, per_index, i, i, True, size, first_slot + m - 1, tag)


def _local_part(c: Cluster, w: Workload, domain: int, transpose: bool, per_index: bool) -> dict:
    """Hierarchical stage 2 (dispatch) or 1 (combine): groups (i, e) -> rank (d, i) sends to
    (d, i + e), e > 0, the tokens of all n/S DCs of its token group for that GPU (dispatch follows
    the destination's weight, combine the sender's)."""
    n, g = c.num_dcs, c.gpus_per_dc
    i, e = np.meshgrid(np.arange(g if per_index else 1), np.arange(1, g), indexing="ij")
    i, e = i.ravel(), e.ravel()
    j = (i + e) % g
    per_peer = w.data_bytes * domain / c.num_ranks * (n // domain)
    size = per_peer * _weights(g, w.skew)[i if transpose else j]
    return _groups(c, per_index, i, j, False, size, e - 1, TOKENS)


def _explicit(c: Cluster, w: Workload, domain: int, kind: str) -> tuple[Network, Flows | None]:
    """The same messages, one flow per GPU pair and one class per physical link (small clusters).

    Peers are found from the definitions (same domain offset / same domain and GPU index) rather
    than the aggregated formulas, so the two constructions check each other.
    """
    n, g = c.num_dcs, c.gpus_per_dc
    ranks = n * g
    wts = _weights(g, w.skew)
    first_slot = c.scatter_slot(domain) if kind == "scatter" else 0
    per_peer = w.data_bytes * domain / ranks
    rows, meta = [], []
    for r in range(ranks):
        d, i = divmod(r, g)
        group = [q for q in range(ranks) if (q // g) % domain == d % domain and q != r]
        if kind in ("gather", "scatter"):
            peers = [
                q
                for q in range(ranks)
                if q // g // domain == d // domain and q % g == i and q // g != d
            ]
            peers.sort(key=lambda q: (q // g - d) % domain)
        elif kind == "wan":  # one message per DC of the token group, to the same GPU index
            peers = sorted((q for q in group if q % g == i), key=lambda q: (q // g - d) % n)
        elif kind.startswith("local"):
            peers = sorted((q for q in group if q // g == d), key=lambda q: (q % g - i) % g)
        else:
            peers = sorted(group, key=lambda q: ((q // g - d) % n, (q % g - i) % g))
        for slot, q in enumerate(peers):
            e = q // g
            path = np.zeros(2 * ranks + 2 * n, dtype=bool)
            path[[r, ranks + q]] = True
            if e != d:
                path[[2 * ranks + d, 2 * ranks + n + e]] = True
            tag = GRADS if kind == "scatter" else TOKENS
            if kind in ("gather", "scatter"):
                size = w.expert_bytes
            elif kind == "wan":
                size = per_peer * wts.sum()
            else:
                size = per_peer * wts[i if kind.endswith("combine") else q % g]
                size *= n // domain if kind.startswith("local") else 1
            latency = c.wan_latency_s if e != d else c.intra_latency_s
            rows.append(path)
            meta.append(
                (size + c.header_bytes, (first_slot + slot) * c.msg_overhead_s + latency, tag)
            )
    gpu, dc = c.gpu_gbps * 1e9 / 8, c.dc_gbps * 1e9 / 8
    net = Network(
        capacity=np.array([gpu] * 2 * ranks + [dc] * 2 * n),
        multiplicity=np.ones(2 * ranks + 2 * n),
        names=tuple(f"link{x}" for x in range(2 * ranks + 2 * n)),
        congestible=np.array([False] * 2 * ranks + [True] * 2 * n),
    )
    if not rows:
        return net, None
    size, start, tag = (np.array(x) for x in zip(*meta, strict=True))
    paths = np.array(rows)
    flows = Flows(
        paths=paths,
        path=np.arange(len(rows)),
        count=np.ones(len(rows)),
        size=size,
        start=start,
        tag=tag.astype(int),
        floor=c.floor(paths[:, 2 * ranks :].any(axis=1)),
    )
    return net, flows


def _phase(
    c: Cluster, w: Workload, domain: int, kinds: tuple[str, ...], aggregate: bool
) -> dict[int, float]:
    """Simulate token / gather traffic started together; end time per tag."""
    per_index = w.skew != 0
    if aggregate:
        parts = []
        for kind in kinds:
            if kind in ("dispatch", "combine"):
                parts.append(_token_part(c, w, domain, kind == "combine", per_index))
            elif kind == "wan":
                size = w.data_bytes * domain / c.num_dcs
                parts.append(_rail_part(c, per_index, c.num_dcs // domain - 1, size, 0, TOKENS))
            elif kind in ("local_dispatch", "local_combine"):
                parts.append(_local_part(c, w, domain, kind == "local_combine", per_index))
            else:  # gather, or the reduce-scatter, posted after the rank's token messages
                first, tag = (0, TOKENS) if kind == "gather" else (c.scatter_slot(domain), GRADS)
                parts.append(_rail_part(c, per_index, domain - 1, w.expert_bytes, first, tag))
        parts = [p for p in parts if p["slot"].size]
        if not parts:
            return {}
        flows = _flows(c, per_index, parts)
        finish = simulate(_network(c, per_index), flows, c.congestion)
    else:
        nets = [_explicit(c, w, domain, k) for k in kinds]
        nets = [(net, f) for net, f in nets if f is not None]
        if not nets:
            return {}
        flows = Flows.concat([f for _, f in nets])
        finish = simulate_reference(nets[0][0], flows, c.congestion)
    return {int(t): phase_end(flows, finish, int(t)) for t in np.unique(flows.tag)}


def _exchange(
    c: Cluster, w: Workload, domain: int, combine: bool, aggregate: bool, scatter: bool = False
) -> tuple[float, float]:
    """One token exchange, dispatch or combine pattern: (tokens end, reduce-scatter end).

    `scatter` runs the reduce-scatter concurrently, from the start of the exchange's cross-DC
    messages (flat: the whole exchange; hierarchical: its WAN stage, after the local one)."""
    extra = ("scatter",) if scatter and domain > 1 else ()
    if not c.hierarchical:
        ends = _phase(c, w, domain, ("combine" if combine else "dispatch", *extra), aggregate)
        return ends.get(TOKENS, 0.0), ends.get(GRADS, 0.0)
    # The stages run one after the other; the WAN stage is the same traffic in both directions.
    local = _phase(c, w, domain, ("local_combine" if combine else "local_dispatch",), aggregate)
    local_s = local.get(TOKENS, 0.0)
    ends = _phase(c, w, domain, ("wan", *extra), aggregate)
    scatter_end = local_s + ends[GRADS] if GRADS in ends else 0.0
    return local_s + ends.get(TOKENS, 0.0), scatter_end


def step_time(c: Cluster, w: Workload, domain: int = 1, *, aggregate: bool = True) -> StepTime:
    """Simulated time of one MoE layer step with DC-level expert domain `domain` (1 = plain EP).

    Args:
      c: the cluster.
      w: the workload.
      domain: S, DCs per expert domain; must divide `c.num_dcs`.
      aggregate: False simulates every GPU flow on every physical link (small clusters only).
    """
    if domain < 1 or c.num_dcs % domain:
        raise ValueError(f"domain size {domain} must divide the DC count {c.num_dcs}")
    fwd_ag = _phase(c, w, domain, ("gather",), aggregate).get(TOKENS, 0.0) if domain > 1 else 0.0
    dispatch = _exchange(c, w, domain, False, aggregate)[0]
    # Uniform routing makes combine the same traffic as dispatch (hierarchical: in reverse).
    combine = dispatch if w.skew == 0 else _exchange(c, w, domain, True, aggregate)[0]
    fwd = max(w.pre_expert_s, fwd_ag) + dispatch + combine + w.compute_s
    m = c.num_dcs // domain
    cross_msgs, local_msgs = c.token_messages(domain)
    wan = w.data_bytes * (m - 1) / m + cross_msgs * c.header_bytes
    ag_wan = (domain - 1) * (w.expert_bytes + c.header_bytes)
    peers = cross_msgs + local_msgs
    if w.forward_only:
        return StepTime(domain, fwd, fwd_ag, dispatch, combine, 0.0, 0.0,
                        w.pre_expert_s + w.compute_s, 2 * wan + ag_wan, peers)  # fmt: skip
    comb_rs, rs = _exchange(c, w, domain, True, aggregate, scatter=True)
    # Backward: combine^T (dispatch pattern), expert backward, dispatch^T (combine pattern) with
    # the reduce-scatter, then pre-expert backward (2x forward) that the reduce-scatter can hide
    # under.
    bwd = dispatch + 2 * w.compute_s + max(comb_rs + 2 * w.pre_expert_s, rs)
    return StepTime(domain, fwd + bwd, fwd_ag, dispatch, combine, comb_rs, rs,
                    3 * (w.pre_expert_s + w.compute_s), 4 * wan + 2 * ag_wan, peers)  # fmt: skip
