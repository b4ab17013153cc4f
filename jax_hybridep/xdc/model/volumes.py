"""Per-level communication volumes of the cross-DC runtime for one domain configuration.

What the runtime moves per rank and per MoE layer, level by level (slow -> fast), for mesh level
sizes `G_l` split into domains `S_l` (outer `n_l = G_l / S_l`, inner `S_l`):

* Experts: all-gathered over the inner axes, slow -> fast; at level l each rank receives
  `(S_l - 1) * prod_{m<l} S_m * E_local` experts (SR-compressed when the migration's
  `compression` is set; `xdc.Migration`). Training adds the transpose, a reduce-scatter of the
  gradients with the same counts: full size, or top-k value-index blocks (an all-to-all) with
  `grad_compression`.
* SR reference (compression only; `Migration.shared`, see `xdc.compress`): "mean" all-reduces one
  expert (each matrix on its own) over each inner axis with `S_l > 1` every layer call,
  `2 (S_l - 1) / S_l * P1` received per rank (`traffic.all_reduce_bytes`, the convention
  `traffic.crossing_bytes` reads programs with); "persistent" all-reduces one expert over all G
  ranks once every `sync_every` steps, across level l `2 P1 (G - G / G_l) / G` per refresh;
  "none" moves nothing.
* Dense gradients (training, `dense_bytes`): the data-parallel all-reduce of the replicated
  parameters' gradients over every rank, by the same convention what comes from peers across
  level l: `2 * dense_bytes * (G - G / G_l) / G`.
* Tokens: hierarchical dispatch over the token EP group (ranks with equal inner coordinates, levels
  with `n_l > 1`), one copy per (token, destination group) per level (docs/design.md §2.1.1;
  the tests hold it to an independent count, `routed_pairs` in tests/harness.py). Counts are
  per exchange; a training step makes 4 exchanges, a forward pass 2.

Two sources: `expected_volumes` (uniform or per-expert-probability routing, expected counts) and
`routed_volumes` (an actual `topk_idx` routing, exact counts). `flat_volumes` models flat plain EP
(one all-to-all over all ranks), the paper's baseline, not this runtime. Numpy only.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

import numpy as np

from jax_hybridep import traffic
from jax_hybridep.values import check_array, check_bool, check_int, check_ints
from jax_hybridep.xdc import geometry
from jax_hybridep.xdc.expert_wire import expert_bytes_on_wire, expert_wire_bytes
from jax_hybridep.xdc.geometry import token_level_sizes
from jax_hybridep.xdc.migration import Migration
from jax_hybridep.xdc.model.loads import exact_loads, expected_loads


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
      shared_sync_bytes: bytes a rank receives in the "mean" reference's all-reduce per layer
        call, `2 (S_l - 1) / S_l * P1` (else 0).
      shared_refresh_bytes: bytes a rank receives from peers across this level in one refresh
        of the "persistent" shared expert (an all-reduce over all G ranks; else 0).
      gather_peers: peers (messages) of the gather and of the reduce-scatter, `S_l - 1`.
      dense_sync_bytes: bytes a rank receives from peers across this level in the dense
        gradients' all-reduce over all G ranks (training only), `2 D (G - G / G_l) / G`.
      dense_peers: messages per phase of that all-reduce at this level, `G_l - 1` (timed as a
        ring over the level: an all-reduce over G ranks need not message all of them).
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
    shared_refresh_bytes: int = 0
    gather_peers: int = 0
    dense_sync_bytes: int = 0
    dense_peers: int = 0

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
      sync_every: steps between refreshes of a persistent shared expert (its bytes per step are
        `shared_refresh_bytes / sync_every`).
    """

    level_sizes: tuple[int, ...]
    domains: tuple[int, ...]
    levels: tuple[LevelVolumes, ...]
    expert_bytes: int
    mode: str = "hierarchical"
    exact: bool = False
    sync_every: int = 1

    @staticmethod
    def token_exchanges(training: bool) -> int:
        """Token exchanges per layer: dispatch and combine, plus their two VJPs when training."""
        check_bool("training", training)
        return 4 if training else 2

    def layer_bytes(self, training: bool = True) -> tuple[float, ...]:
        """Bytes per rank at each level of one MoE layer in one step: tokens, gather,
        reduce-scatter, the reference's sync and its refresh (per step: over `sync_every`)."""
        n = self.token_exchanges(training)
        return tuple(
            n * v.token_bytes
            + v.gather_bytes
            + (v.reduce_scatter_bytes if training else 0)
            + v.shared_sync_bytes
            + v.shared_refresh_bytes / self.sync_every
            for v in self.levels
        )

    def step_bytes(self, training: bool = True, layers: int = 1) -> tuple[float, ...]:
        """Bytes per rank at each level of a step of `layers` MoE layers (`layer_bytes` each);
        once per step the dense gradients."""
        check_int("layers", layers, 1)
        return tuple(
            layers * b + (v.dense_sync_bytes if training else 0)
            for b, v in zip(self.layer_bytes(training), self.levels, strict=True)
        )


def realisable_domains(level_sizes: Sequence[int]) -> list[tuple[int, ...]]:
    """Every domain tuple: one divisor of each level size, plain EP (all 1) first."""
    level_sizes = check_ints("level_sizes", level_sizes, 1)
    divisors = [[d for d in range(1, g + 1) if g % d == 0] for g in level_sizes]
    return list(itertools.product(*divisors))


def _check(level_sizes, domains, num_experts, top_k=None, **sizes):
    """Validated (level sizes, domains); `sizes` are counts that must be >= 0 (dense_bytes,
    tokens) or >= 1 (hidden, act_bytes)."""
    # Fractional sizes are refused, never truncated (a domain of 1.5 is not plain EP).
    level_sizes = check_ints("level_sizes", level_sizes, 1)
    domains = check_ints("domains", domains, 1)
    if len(level_sizes) != len(domains):
        raise ValueError(f"domains {domains} do not match level sizes {level_sizes}")
    check_int("num_experts", num_experts, 1)
    if top_k is not None:
        check_int("top_k", top_k, 1)
    for name, value in sizes.items():
        check_int(name, value, 1 if name in ("hidden", "act_bytes") else 0)
    bad = [(g, s) for g, s in zip(level_sizes, domains, strict=True) if s < 1 or g % s]
    if bad:
        raise ValueError(f"domain sizes must divide their level sizes; got {bad} (G_l, S_l)")
    ranks = math.prod(level_sizes)
    if num_experts < 1 or num_experts % ranks:
        raise ValueError(f"num_experts={num_experts} is not a multiple of the {ranks} ranks")
    if top_k is not None and not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must lie in [1, num_experts={num_experts}]")
    return level_sizes, domains


def _dense(level_sizes, lvl: int, dense_bytes: int) -> tuple[int, int]:
    """(bytes, peers) of the dense gradients' all-reduce over all ranks across level `lvl`:
    bytes as the direct exchange the programs are read with, peers as a ring over the level."""
    ranks = math.prod(level_sizes)
    across = ranks - ranks // level_sizes[lvl]
    return traffic.all_reduce_bytes(dense_bytes, ranks, across), level_sizes[lvl] - 1


def _experts(expert_bytes, expert_matrices, value_bytes, migration: Migration | None):
    """What one expert costs under `migration`: (P1, forward wire bytes, bytes per matrix,
    reference variant or None without SR, gradient wire bytes, sync_every), validated."""
    migration = Migration() if migration is None else migration
    if not isinstance(migration, Migration):
        raise TypeError(f"migration must be a jax_hybridep.xdc.Migration, got {migration!r}")
    p1, sent, matrices, compressed = expert_bytes_on_wire(
        expert_bytes, expert_matrices, migration.compression, value_bytes
    )
    matrices_spec = expert_matrices if expert_matrices is not None else [p1 // value_bytes]
    grad = expert_wire_bytes(matrices_spec, migration.grad_compression, value_bytes)
    reference = migration.shared if compressed else None
    return p1, sent, matrices, reference, grad, migration.sync_every


def _build(
    level_sizes, domains, loads, *, local, tokens, hidden, act_bytes, experts, exact, dense_bytes
):
    """`Volumes` from per-full-rank loads [3 (copies, sent, received), G, token levels]."""
    p1, wire, matrices, reference, grad_wire, sync_every = experts
    migrating = any(s > 1 for s in domains)
    ranks = math.prod(level_sizes)
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
        sync = 0
        if reference == "mean" and s > 1:
            sync = sum(traffic.all_reduce_bytes(m, s, s - 1) for m in matrices)
        refresh = 0
        if reference == "persistent" and migrating:
            across = ranks - ranks // g
            refresh = sum(traffic.all_reduce_bytes(m, ranks, across) for m in matrices)
        dense, dense_peers = _dense(level_sizes, lvl, dense_bytes)
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
                reduce_scatter_bytes=gathered * grad_wire,
                shared_sync_bytes=sync,
                shared_refresh_bytes=refresh,
                gather_peers=s - 1,
                dense_sync_bytes=dense,
                dense_peers=dense_peers if dense else 0,
            )
        )
    return Volumes(level_sizes, domains, tuple(levels), p1, "hierarchical", exact, sync_every)


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
    migration: Migration | None = None,
    value_bytes: int = 4,
    expert_probs: Sequence[float] | None = None,
    dense_bytes: int = 0,
) -> Volumes:
    """Expected per-level volumes for routing of K distinct experts per token.

    Args:
      level_sizes: mesh level sizes `G_l`, slow -> fast.
      domains: domain size `S_l` per level (divisors of `G_l`).
      tokens, top_k, num_experts, hidden, act_bytes: `T` per rank, `K`, `E`, `H`, token bytes.
      expert_bytes: `P1`, one expert's parameter bytes (treated as one matrix when compressed).
      expert_matrices: alternatively, the element count (or shape) of each expert matrix.
      migration: how experts travel (`xdc.Migration`: SR compression of the forward gather,
        its reference variant and refresh period, gradient compression; its domains are not
        read: `domains` above are the sizes); None: full experts, exact gradients.
      value_bytes: bytes per parameter value.
      expert_probs: [E] routing probability of each expert (default uniform); the busiest rank
        and site then carry more than the mean.
      dense_bytes: bytes of the replicated parameters whose gradients a training step
        all-reduces over every rank (0: not counted).
    """
    level_sizes, domains = _check(
        level_sizes,
        domains,
        num_experts,
        top_k,
        tokens=tokens,
        hidden=hidden,
        act_bytes=act_bytes,
        dense_bytes=dense_bytes,
    )
    experts = _experts(expert_bytes, expert_matrices, value_bytes, migration)
    if expert_probs is None:
        probs = np.full(num_experts, 1 / num_experts)
    else:
        probs = check_array("expert_probs", expert_probs, ndim=1, lo=0)  # NaN: ValueError
        if probs.shape != (num_experts,) or probs.sum() <= 0:
            raise ValueError(f"expert_probs must be [{num_experts}] non-negative, not all 0")
        probs = probs / probs.sum()
    token_sizes = token_level_sizes(level_sizes, domains)
    groups = geometry.replica_placement(level_sizes, domains, num_experts)[0]
    per_rank = np.stack(expected_loads(token_sizes, groups, probs, tokens, top_k))
    # Every token group sees the same routing statistics.
    per_group = np.broadcast_to(per_rank[:, None], (3, math.prod(domains), *per_rank.shape[1:]))
    loads = np.stack([_to_full(level_sizes, domains, a) for a in per_group])
    local = num_experts // math.prod(level_sizes)
    return _build(
        level_sizes,
        domains,
        loads,
        local=local,
        tokens=tokens,
        hidden=hidden,
        act_bytes=act_bytes,
        experts=experts,
        exact=False,
        dense_bytes=dense_bytes,
    )


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
    migration: Migration | None = None,
    value_bytes: int = 4,
    dense_bytes: int = 0,
) -> Volumes:
    """Exact per-level volumes of an actual routing.

    Args:
      topk_idx: [G, T, K] global expert ids of every rank's tokens (full mesh rank order,
        row-major over levels), -1 for none. Expert e lives on rank `e // E_local`; a sender uses
        the replica in its own token group (owner's outer coordinates, its own inner ones).
      Others: as `expected_volumes`.
    """
    level_sizes, domains = _check(
        level_sizes,
        domains,
        num_experts,
        hidden=hidden,
        act_bytes=act_bytes,
        dense_bytes=dense_bytes,
    )
    topk_idx = check_array("topk_idx", topk_idx, integer=True)
    ranks = math.prod(level_sizes)
    if topk_idx.ndim != 3 or topk_idx.shape[0] != ranks:
        raise ValueError(f"topk_idx must be [G={ranks}, T, K], got {topk_idx.shape}")
    if topk_idx.max(initial=-1) >= num_experts or topk_idx.min(initial=0) < -1:
        raise ValueError(f"topk_idx holds ids outside [-1, {num_experts})")
    experts = _experts(expert_bytes, expert_matrices, value_bytes, migration)
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
        level_sizes,
        domains,
        loads,
        local=num_experts // ranks,
        tokens=topk_idx.shape[1],
        hidden=hidden,
        act_bytes=act_bytes,
        experts=experts,
        exact=True,
        dense_bytes=dense_bytes,
    )


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
    dense_bytes: int = 0,
) -> Volumes:
    """Expected volumes of flat plain EP (one all-to-all over all ranks; the paper's baseline).

    A rank sends to every other rank directly; a copy travels over the slowest level at which
    the two ranks differ. `dedup` sends one copy per (token, destination rank) under uniform
    routing; otherwise one per (token, k) as capacity-style buffers (Tutel) do, `T K / G` per peer.
    `dense_bytes` as in `expected_volumes`.
    """
    check_bool("dedup", dedup)
    check_int("expert_bytes", expert_bytes, 0)
    level_sizes, _ = _check(
        level_sizes,
        (1,) * len(level_sizes),
        num_experts,
        top_k,
        tokens=tokens,
        hidden=hidden,
        act_bytes=act_bytes,
        dense_bytes=dense_bytes,
    )
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
        dense, dense_peers = _dense(level_sizes, lvl, dense_bytes)
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
                dense_sync_bytes=dense,
                dense_peers=dense_peers if dense else 0,
            )
        )
    return Volumes(level_sizes, (1,) * len(level_sizes), tuple(levels), expert_bytes, "flat")
