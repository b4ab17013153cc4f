"""The messages of a simulated MoE layer step, as flow groups: aggregated over the cluster's
symmetry (`flows`, any size) or one flow per GPU pair on every physical link (`explicit`, small
clusters; built from the definitions rather than the aggregated formulas, so the two check each
other).

Messages: a rank posts its messages one after the other, `msg_overhead_s` apart (CPU/NIC cost per
message), in rotated order (nearest peer offset first); a message's bytes start `latency` after it
is posted (one-way WAN or intra-DC latency) and carry `header_bytes` on top of the payload.
Intra-DC messages cross the two GPU links; cross-DC messages cross GPU up, DC up, DC down, GPU
down.

Token exchanges (`Datacenters.exchange`): "hierarchical" sends one cross-DC message per destination
DC, to the rank with the sender's GPU index, carrying the tokens of all that DC's GPUs; a second
stage forwards them inside the DC. "flat" sends every rank's tokens to every peer rank directly.
With domain size S (DC d = o*S + s is in domain o at offset s) a token for an expert at (d', j)
goes to the replica at (d'', j), d'' the DC of d''s domain at offset s, so tokens move among the
G/S ranks whose DC has the sender's offset. The gather, the reduce-scatter and the shared-expert
sync go to the ranks with the sender's GPU index in the other S - 1 DCs of its domain.

Routing is uniform, or skewed by a Zipf exponent over the destination GPU index (the same in
every DC, so the traffic keeps its rotation symmetry over DCs and stays aggregated).
"""

from __future__ import annotations

import numpy as np

from jax_hybridep.sim.cluster import TOKENS, Datacenters, MoELayer, Phase
from jax_hybridep.sim.network import Flows, Network


def weights(g: int, skew: float) -> np.ndarray:
    """Routing weight of each destination GPU index, mean 1 (a rank still feeds D bytes in all)."""
    w = (1.0 + np.arange(g)) ** -skew
    return w * g / w.sum()


def _network(c: Datacenters, per_index: bool) -> Network:
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


def _flows(c: Datacenters, per_index: bool, parts: list[dict]) -> Flows:
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


def _groups(c: Datacenters, per_index: bool, src, dst, cross, size, slot, tag: int) -> dict:
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


def _token_part(c: Datacenters, w: MoELayer, domain: int, transpose: bool, per_index: bool):
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
    size = w.data_bytes * domain / c.num_ranks * weights(g, w.skew)[i if transpose else j]
    return _groups(c, per_index, i, j, m > 0, size, m * g + e - 1, TOKENS)


def _rail_part(
    c: Datacenters, per_index: bool, messages: int, size: float, first_slot: int, tag: int
) -> dict:
    """Rank (d, i) sends `size` bytes to the rank with its GPU index in each of `messages` other
    DCs, posted from `first_slot` on: groups (m, i). The hierarchical exchange's WAN stage (one
    message per DC of the token group, the tokens of all its g GPUs; the weights average 1, so
    skew leaves it uniform), and within the domain (one message per other DC of it) the expert
    all-gather, the reduce-scatter and each half of the shared-expert all-reduce."""
    m, i = np.meshgrid(
        np.arange(1, messages + 1), np.arange(c.gpus_per_dc if per_index else 1), indexing="ij"
    )
    m, i = m.ravel(), i.ravel()
    return _groups(c, per_index, i, i, True, size, first_slot + m - 1, tag)


def _local_part(c: Datacenters, w: MoELayer, domain: int, transpose: bool, per_index: bool):
    """Hierarchical stage 2 (dispatch) or 1 (combine): groups (i, e) -> rank (d, i) sends to
    (d, i + e), e > 0, the tokens of all n/S DCs of its token group for that GPU (dispatch follows
    the destination's weight, combine the sender's)."""
    n, g = c.num_dcs, c.gpus_per_dc
    i, e = np.meshgrid(np.arange(g if per_index else 1), np.arange(1, g), indexing="ij")
    i, e = i.ravel(), e.ravel()
    j = (i + e) % g
    per_peer = w.data_bytes * domain / c.num_ranks * (n // domain)
    size = per_peer * weights(g, w.skew)[i if transpose else j]
    return _groups(c, per_index, i, j, False, size, e - 1, TOKENS)


def rail_bytes(w: MoELayer, domain: int, phase: Phase) -> float:
    """Payload of one message of a domain phase: gather, reduce-scatter, shared-sync half."""
    if phase is Phase.GATHER:
        return w.gather_bytes
    if phase is Phase.SCATTER:
        return w.scatter_bytes
    return w.expert_bytes / domain


def aggregated(
    c: Datacenters, w: MoELayer, domain: int, phases: tuple[Phase, ...]
) -> tuple[Network, Flows] | None:
    """The messages of `phases`, started together, as aggregated groups (None if there are none)."""
    per_index = w.skew != 0
    parts = []
    for phase in phases:
        if phase in (Phase.DISPATCH, Phase.COMBINE):
            parts.append(_token_part(c, w, domain, phase.transposed, per_index))
        elif phase is Phase.WAN:
            size = w.data_bytes * domain / c.num_dcs
            parts.append(_rail_part(c, per_index, c.num_dcs // domain - 1, size, 0, TOKENS))
        elif phase.local:
            parts.append(_local_part(c, w, domain, phase.transposed, per_index))
        else:  # the reduce-scatter is posted after the rank's token messages
            first = c.scatter_slot(domain) if phase is Phase.SCATTER else 0
            size = rail_bytes(w, domain, phase)
            parts.append(_rail_part(c, per_index, domain - 1, size, first, phase.tag))
    parts = [p for p in parts if p["slot"].size]
    if not parts:
        return None
    return _network(c, per_index), _flows(c, per_index, parts)


def _explicit_one(
    c: Datacenters, w: MoELayer, domain: int, phase: Phase
) -> tuple[Network, Flows | None]:
    """One phase's messages, one flow per GPU pair and one class per physical link.

    Peers are found from the definitions (same domain offset / same domain and GPU index) rather
    than the aggregated formulas.
    """
    n, g = c.num_dcs, c.gpus_per_dc
    ranks = n * g
    wts = weights(g, w.skew)
    first_slot = c.scatter_slot(domain) if phase is Phase.SCATTER else 0
    per_peer = w.data_bytes * domain / ranks
    rows, meta = [], []
    for r in range(ranks):
        d, i = divmod(r, g)
        group = [q for q in range(ranks) if (q // g) % domain == d % domain and q != r]
        if phase.rail:
            peers = [
                q
                for q in range(ranks)
                if q // g // domain == d // domain and q % g == i and q // g != d
            ]
            peers.sort(key=lambda q: (q // g - d) % domain)
        elif phase is Phase.WAN:  # one message per DC of the token group, to the same GPU index
            peers = sorted((q for q in group if q % g == i), key=lambda q: (q // g - d) % n)
        elif phase.local:
            peers = sorted((q for q in group if q // g == d), key=lambda q: (q % g - i) % g)
        else:
            peers = sorted(group, key=lambda q: ((q // g - d) % n, (q % g - i) % g))
        for slot, q in enumerate(peers):
            e = q // g
            path = np.zeros(2 * ranks + 2 * n, dtype=bool)
            path[[r, ranks + q]] = True
            if e != d:
                path[[2 * ranks + d, 2 * ranks + n + e]] = True
            if phase.rail:
                size = rail_bytes(w, domain, phase)
            elif phase is Phase.WAN:
                size = per_peer * wts.sum()
            else:
                size = per_peer * wts[i if phase.transposed else q % g]
                size *= n // domain if phase.local else 1
            latency = c.wan_latency_s if e != d else c.intra_latency_s
            rows.append(path)
            meta.append(
                (size + c.header_bytes, (first_slot + slot) * c.msg_overhead_s + latency, phase.tag)
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


def explicit(
    c: Datacenters, w: MoELayer, domain: int, phases: tuple[Phase, ...]
) -> tuple[Network, Flows] | None:
    """The messages of `phases` as one flow per GPU pair (None if there are none)."""
    nets = [_explicit_one(c, w, domain, phase) for phase in phases]
    nets = [(net, f) for net, f in nets if f is not None]
    if not nets:
        return None
    return nets[0][0], Flows.concat([f for _, f in nets])
