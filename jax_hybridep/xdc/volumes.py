"""Per-level communication volumes of the cross-DC runtime for one domain configuration.

What the runtime moves per rank and per MoE layer, level by level (slow -> fast), for mesh level
sizes `G_l` split into domains `S_l` (outer `n_l = G_l / S_l`, inner `S_l`):

* Experts: all-gathered over the inner axes, slow -> fast; at level l each rank receives
  `(S_l - 1) * prod_{m<l} S_m * E_local` experts (compressed when `ratio` is set). Training adds
  the transpose, a reduce-scatter of full-size gradients with the same counts.
* Shared-expert sync (compression only): an all-reduce of one expert's `P1` bytes over each inner
  axis with `S_l > 1`.
* Tokens: hierarchical dispatch over the token EP group (ranks with equal inner coordinates, levels
  with `n_l > 1`), one copy per (token, destination group) per level, as `traffic.routed_pairs`
  counts. Counts are per exchange; a training step makes 4 exchanges, a forward pass 2.

Two sources: `expected_volumes` (uniform or per-expert-probability routing, expected counts) and
`routed_volumes` (an actual `topk_idx` routing, exact counts). `flat_volumes` models flat plain EP
(one all-to-all over all ranks), the paper's baseline, not this runtime. Host-side numpy only.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

import numpy as np

from jax_hybridep import traffic
from jax_hybridep.xdc import geometry
from jax_hybridep.xdc.geometry import token_level_sizes

INDEX_BYTES = 4  # compressed experts carry int32 indices


@dataclasses.dataclass(frozen=True)
class LevelVolumes:
    """One level's volumes, per rank and per MoE layer (one exchange for tokens).

    Attributes:
      size, domain, outer: `G_l`, `S_l` and `n_l = G_l / S_l`.
      token_copies: token copies a rank sends at this level in one exchange (mean over ranks).
      token_copies_max: the busiest rank's copies (max over ranks of sent and received).
      token_site_copies_max: the busiest site's copies (sum over the `site_ranks` ranks that share
        this level's uplink, max over sites and over sent/received).
      row_bytes: bytes of one token copy (`H * act_bytes`).
      token_peers: peers (messages) per exchange, `n_l - 1` (0 when no tokens cross the level).
      site_ranks: ranks sharing one site's uplink at this level, `prod_{m>l} G_m`.
      padded_token_bytes: the `xla` backend's static send buffer at this level.
      gather_experts: experts a rank receives in the forward all-gather.
      gather_bytes: forward all-gather bytes received per rank.
      reduce_scatter_bytes: backward reduce-scatter gradient bytes per rank (training only).
      shared_sync_bytes: shared-expert all-reduce payload (`P1`, compression only, else 0).
      gather_peers: peers (messages) of the gather and of the reduce-scatter, `S_l - 1`.
    """

    size: int
    domain: int
    outer: int
    token_copies: float
    token_copies_max: float
    token_site_copies_max: float
    row_bytes: int
    token_peers: int
    site_ranks: int
    padded_token_bytes: int = 0
    gather_experts: int = 0
    gather_bytes: int = 0
    reduce_scatter_bytes: int = 0
    shared_sync_bytes: int = 0
    gather_peers: int = 0

    @property
    def token_bytes(self) -> float:
        """Token payload bytes a rank sends at this level in one exchange (mean)."""
        return self.token_copies * self.row_bytes

    @property
    def token_bytes_max(self) -> float:
        return self.token_copies_max * self.row_bytes

    @property
    def token_site_bytes_max(self) -> float:
        return self.token_site_copies_max * self.row_bytes


@dataclasses.dataclass(frozen=True)
class Volumes:
    """All levels' volumes of one configuration.

    Attributes:
      level_sizes, domains: the mesh level sizes `G_l` and domain sizes `S_l`.
      levels: per level, its `LevelVolumes`.
      expert_bytes: `P1`, one expert's uncompressed parameter bytes.
      mode: "hierarchical" (this runtime: levels one after another) or "flat" (one all-to-all).
      exact: True when counted from an actual routing, False for expected counts.
    """

    level_sizes: tuple[int, ...]
    domains: tuple[int, ...]
    levels: tuple[LevelVolumes, ...]
    expert_bytes: int
    mode: str = "hierarchical"
    exact: bool = False

    @staticmethod
    def token_exchanges(training: bool) -> int:
        """Token exchanges per layer: dispatch and combine, plus their two VJPs when training."""
        return 4 if training else 2

    def step_bytes(self, training: bool = True) -> tuple[float, ...]:
        """Bytes per rank and layer at each level: tokens, gather, reduce-scatter, shared sync."""
        n = self.token_exchanges(training)
        return tuple(
            n * v.token_bytes
            + v.gather_bytes
            + (v.reduce_scatter_bytes if training else 0)
            + v.shared_sync_bytes
            for v in self.levels
        )


def realisable_domains(level_sizes: Sequence[int]) -> list[tuple[int, ...]]:
    """Every domain tuple: one divisor of each level size, plain EP (all 1) first."""
    divisors = [[d for d in range(1, g + 1) if g % d == 0] for g in level_sizes]
    return list(itertools.product(*divisors))


def topk_count(elements: int, ratio: float, value_bytes: int) -> int:
    """Values kept of an `elements`-element matrix compressed by `ratio` in value-index form."""
    return max(1, math.floor(elements * value_bytes / (ratio * (value_bytes + INDEX_BYTES))))


def expert_wire_bytes(matrices: Sequence, ratio: float | None, value_bytes: int) -> int:
    """Bytes one expert takes on the wire: `P1`, or the sum of `k * (vb + ib)` when compressed.

    Args:
      matrices: per matrix, its element count or its shape.
      ratio: compression ratio; None or <= 1 sends the matrices as they are.
      value_bytes: bytes per parameter value.
    """
    sizes = [m if isinstance(m, int | np.integer) else math.prod(m) for m in matrices]
    if ratio is None or ratio <= 1:
        return sum(sizes) * value_bytes
    return sum(topk_count(n, ratio, value_bytes) * (value_bytes + INDEX_BYTES) for n in sizes)


def _experts(expert_bytes, expert_matrices, ratio, value_bytes) -> tuple[int, int, bool]:
    """(P1, bytes per expert on the wire, compressed?)."""
    if (expert_bytes is None) == (expert_matrices is None):
        raise ValueError("give exactly one of expert_bytes and expert_matrices")
    if expert_matrices is None:
        if expert_bytes % value_bytes:
            raise ValueError(f"expert_bytes={expert_bytes} is not a multiple of {value_bytes=}")
        # One matrix: compressed bytes are then approximate (the runtime rounds k per matrix).
        expert_matrices = [expert_bytes // value_bytes]
    return (
        expert_wire_bytes(expert_matrices, None, value_bytes),
        expert_wire_bytes(expert_matrices, ratio, value_bytes),
        ratio is not None and ratio > 1,
    )


def _check(level_sizes, domains, num_experts, top_k=None):
    level_sizes, domains = tuple(int(g) for g in level_sizes), tuple(int(s) for s in domains)
    if len(level_sizes) != len(domains):
        raise ValueError(f"domains {domains} do not match level sizes {level_sizes}")
    bad = [(g, s) for g, s in zip(level_sizes, domains, strict=True) if s < 1 or g % s]
    if bad:
        raise ValueError(f"domain sizes must divide their level sizes; got {bad} (G_l, S_l)")
    ranks = math.prod(level_sizes)
    if num_experts % ranks:
        raise ValueError(f"num_experts={num_experts} is not a multiple of the {ranks} ranks")
    if top_k is not None and not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must lie in [1, num_experts={num_experts}]")
    return level_sizes, domains


def exact_loads(dest, token_sizes: Sequence[int]):
    """Exact per-rank token copies per level for one token group.

    Args:
      dest: [R, T, K] destination rank in the group of each (source, t, k), -1 for none.
      token_sizes: the group's level sizes.

    Returns:
      (copies, sent, received), each [R, levels] int64: copies by source rank (summed over
      sources this equals `traffic.routed_pairs`), and by the rank that actually sends and
      receives each copy (at level l a copy goes from the rank holding the destination's
      coordinates below l and the source's from l on, to the destination's coordinates up to l).
    """
    dest = np.asarray(dest)
    ranks = dest.shape[0]
    strides = [math.prod(token_sizes[i + 1 :]) for i in range(len(token_sizes))]
    out = np.zeros((3, ranks, len(token_sizes)), np.int64)
    src = np.arange(ranks)[:, None, None]
    for lvl, (n, stride) in enumerate(zip(token_sizes, strides, strict=True)):
        prefix = np.where(dest >= 0, dest // stride, -1)
        keep = (dest >= 0) & (prefix % n != (src // stride) % n)
        p = np.sort(np.where(keep, prefix, -1), axis=-1)
        new = p >= 0
        new[..., 1:] &= p[..., 1:] != p[..., :-1]  # one copy per (token, destination prefix)
        s, t, k = np.nonzero(new)
        pp = p[s, t, k]
        out[0, :, lvl] = np.bincount(s, minlength=ranks)
        out[1, :, lvl] = np.bincount((pp // n) * n * stride + s % (n * stride), minlength=ranks)
        out[2, :, lvl] = np.bincount(pp * stride + s % stride, minlength=ranks)
    return out[0], out[1], out[2]


def _expected_loads(token_sizes, groups, probs, tokens, top_k):
    """Expected (copies, sent, received) [R, levels] per token-group rank.

    A prefix holding routing mass P is hit with probability `1 - prod_{i<K} (1 - P E/(E-i))`:
    exact for uniform routing (the hypergeometric `1 - C(E-E_p, K)/C(E, K)`), an approximation
    of drawing K distinct experts without replacement otherwise.
    """
    num_experts = len(probs)
    ranks = math.prod(token_sizes)
    out = np.zeros((3, ranks, len(token_sizes)))
    rank = np.arange(ranks)
    for lvl, n in enumerate(token_sizes):
        stride = math.prod(token_sizes[lvl + 1 :])
        above = math.prod(token_sizes[:lvl])
        mass = np.bincount(groups // stride, weights=probs, minlength=above * n)
        miss = np.ones_like(mass)
        for i in range(top_k):
            miss *= np.clip(1 - mass * num_experts / (num_experts - i), 0, None)
        hit = (1 - miss).reshape(above, n)
        own = (rank // stride) % n
        # Copies by source: every prefix whose level coordinate differs from the source's.
        out[0, :, lvl] = tokens * (hit.sum() - hit.sum(0)[own])
        block = (rank // (n * stride)) % above
        out[1, :, lvl] = tokens * above * (hit[block].sum(1) - hit[block, own])
        out[2, :, lvl] = tokens * above * (n - 1) * hit[block, own]
    return out[0], out[1], out[2]


def _build(level_sizes, domains, loads, *, local, tokens, hidden, act_bytes, experts, exact):
    """`Volumes` from per-full-rank loads [3 (copies, sent, received), G, token levels]."""
    p1, wire, compressed = experts
    outer = [g // s for g, s in zip(level_sizes, domains, strict=True)]
    token_sizes = token_level_sizes(level_sizes, domains)
    padded = traffic.padded_buffer_bytes(token_sizes, tokens, hidden, act_bytes)
    levels, tok = [], 0
    for lvl, (g, s, n) in enumerate(zip(level_sizes, domains, outer, strict=True)):
        site = math.prod(level_sizes[lvl + 1 :])
        mean = busiest = sites = 0.0
        if n > 1:
            copies, sent, recv = loads[:, :, tok]
            mean, busiest = copies.sum() / copies.size, max(sent.max(), recv.max())
            shape = (-1, site)
            sites = max(sent.reshape(shape).sum(1).max(), recv.reshape(shape).sum(1).max())
            tok += 1
        gathered = (s - 1) * math.prod(domains[:lvl]) * local
        levels.append(
            LevelVolumes(
                size=g,
                domain=s,
                outer=n,
                token_copies=float(mean),
                token_copies_max=float(busiest),
                token_site_copies_max=float(sites),
                row_bytes=hidden * act_bytes,
                token_peers=n - 1,
                site_ranks=site,
                padded_token_bytes=padded[tok - 1] if n > 1 else 0,
                gather_experts=gathered,
                gather_bytes=gathered * wire,
                reduce_scatter_bytes=gathered * p1,
                shared_sync_bytes=p1 if compressed and s > 1 else 0,
                gather_peers=s - 1,
            )
        )
    return Volumes(level_sizes, domains, tuple(levels), p1, "hierarchical", exact)


def _to_full(level_sizes, domains, per_group):
    """[G, levels] per full rank from per-token-group-rank loads (group index, group rank)."""
    coords = np.indices(level_sizes).reshape(len(level_sizes), -1)
    inner = [c % s for c, s in zip(coords, domains, strict=True)]
    outer = [c // s for c, s in zip(coords, domains, strict=True)]
    group = np.ravel_multi_index(inner, domains)
    member = np.ravel_multi_index(
        outer, [g // s for g, s in zip(level_sizes, domains, strict=True)]
    )
    return per_group[group, member]


def expected_volumes(
    level_sizes: Sequence[int],
    domains: Sequence[int],
    *,
    tokens: int,
    top_k: int,
    num_experts: int,
    hidden: int,
    act_bytes: int,
    expert_bytes: int | None = None,
    expert_matrices: Sequence | None = None,
    ratio: float | None = None,
    value_bytes: int = 4,
    expert_probs: Sequence[float] | None = None,
) -> Volumes:
    """Expected per-level volumes for routing of K distinct experts per token.

    Args:
      level_sizes: mesh level sizes `G_l`, slow -> fast.
      domains: domain size `S_l` per level (divisors of `G_l`).
      tokens, top_k, num_experts, hidden, act_bytes: `T` per rank, `K`, `E`, `H`, token bytes.
      expert_bytes: `P1`, one expert's parameter bytes (treated as one matrix when compressed).
      expert_matrices: alternatively, the element count (or shape) of each expert matrix.
      ratio: compression ratio of the forward gather (None or <= 1: off).
      value_bytes: bytes per parameter value.
      expert_probs: [E] routing probability of each expert (default uniform); the busiest rank
        and site then carry more than the mean.
    """
    level_sizes, domains = _check(level_sizes, domains, num_experts, top_k)
    experts = _experts(expert_bytes, expert_matrices, ratio, value_bytes)
    if expert_probs is None:
        probs = np.full(num_experts, 1 / num_experts)
    else:
        probs = np.asarray(expert_probs, np.float64)
        if probs.shape != (num_experts,) or probs.min() < 0 or probs.sum() <= 0:
            raise ValueError(f"expert_probs must be [{num_experts}] non-negative, not all 0")
        probs = probs / probs.sum()
    token_sizes = token_level_sizes(level_sizes, domains)
    groups = geometry.replica_placement(level_sizes, domains, num_experts)[0]
    per_rank = np.stack(_expected_loads(token_sizes, groups, probs, tokens, top_k))
    # Every token group sees the same routing statistics.
    per_group = np.broadcast_to(per_rank[:, None], (3, math.prod(domains), *per_rank.shape[1:]))
    loads = np.stack([_to_full(level_sizes, domains, a) for a in per_group])
    local = num_experts // math.prod(level_sizes)
    return _build(
        level_sizes, domains, loads, local=local, tokens=tokens, hidden=hidden,
        act_bytes=act_bytes, experts=experts, exact=False,
    )  # fmt: skip


def routed_volumes(
    level_sizes: Sequence[int],
    domains: Sequence[int],
    topk_idx,
    *,
    num_experts: int,
    hidden: int,
    act_bytes: int,
    expert_bytes: int | None = None,
    expert_matrices: Sequence | None = None,
    ratio: float | None = None,
    value_bytes: int = 4,
) -> Volumes:
    """Exact per-level volumes of an actual routing.

    Args:
      topk_idx: [G, T, K] global expert ids of every rank's tokens (full mesh rank order,
        row-major over levels), -1 for none. Expert e lives on rank `e // E_local`; a sender uses
        the replica in its own token group (owner's outer coordinates, its own inner ones).
      Others: as `expected_volumes`.
    """
    level_sizes, domains = _check(level_sizes, domains, num_experts)
    topk_idx = np.asarray(topk_idx)
    ranks = math.prod(level_sizes)
    if topk_idx.ndim != 3 or topk_idx.shape[0] != ranks:
        raise ValueError(f"topk_idx must be [G={ranks}, T, K], got {topk_idx.shape}")
    if topk_idx.max(initial=-1) >= num_experts or topk_idx.min(initial=0) < -1:
        raise ValueError(f"topk_idx holds ids outside [-1, {num_experts})")
    experts = _experts(expert_bytes, expert_matrices, ratio, value_bytes)
    groups = geometry.replica_placement(level_sizes, domains, num_experts)[0]
    dest = np.where(topk_idx >= 0, groups[np.maximum(topk_idx, 0)], -1)
    token_sizes = token_level_sizes(level_sizes, domains)
    # Reorder the full ranks into [token group, group rank] to count each group exactly.
    member_of = _to_full(level_sizes, domains, np.arange(ranks).reshape(math.prod(domains), -1))
    by_group = np.empty_like(dest)
    by_group[member_of] = dest
    by_group = by_group.reshape(math.prod(domains), -1, *dest.shape[1:])
    per_group = np.stack([np.stack(exact_loads(d, token_sizes)) for d in by_group], axis=1)
    loads = np.stack([_to_full(level_sizes, domains, a) for a in per_group])
    return _build(
        level_sizes, domains, loads, local=num_experts // ranks, tokens=topk_idx.shape[1],
        hidden=hidden, act_bytes=act_bytes, experts=experts, exact=True,
    )  # fmt: skip


def flat_volumes(
    level_sizes: Sequence[int],
    *,
    tokens: int,
    top_k: int,
    num_experts: int,
    hidden: int,
    act_bytes: int,
    dedup: bool = True,
    expert_bytes: int = 0,
) -> Volumes:
    """Expected volumes of flat plain EP (one all-to-all over all ranks; the paper's baseline).

    A rank sends to every other rank directly; a copy travels over the slowest level at which
    the two ranks differ. `dedup` sends one copy per (token, destination rank) under uniform
    routing; otherwise one per (token, k) as capacity-style buffers (Tutel) do, `T K / G` per peer.
    """
    level_sizes, _ = _check(level_sizes, (1,) * len(level_sizes), num_experts, top_k)
    ranks = math.prod(level_sizes)
    local = num_experts // ranks
    if dedup:
        per_peer = tokens * (
            1 - math.comb(num_experts - local, top_k) / math.comb(num_experts, top_k)
        )
    else:
        per_peer = tokens * top_k / ranks
    levels = []
    for lvl, g in enumerate(level_sizes):
        site = math.prod(level_sizes[lvl + 1 :])
        copies = per_peer * site * (g - 1)
        levels.append(
            LevelVolumes(
                size=g,
                domain=1,
                outer=g,
                token_copies=copies,
                token_copies_max=copies,
                token_site_copies_max=copies * site,
                row_bytes=hidden * act_bytes,
                token_peers=site * (g - 1),
                site_ranks=site,
            )
        )
    return Volumes(level_sizes, (1,) * len(level_sizes), tuple(levels), expert_bytes, "flat")
