"""Replicas at run time (per shard, inside `jax.shard_map`): logical ids -> physical slots
before `dispatch`, and the replica weights fetched from their primaries.

    rep = balance.Replicas(placement, topology)
    w_slots = rep.gather(w_local)                  # [E/R, ...] stored -> [L, ...] per slot
    d = rep.dispatch(x, topk_idx, topk_weights, config=cfg)   # topk_idx stays logical
    y = experts(d.tokens, d.group_sizes, w_slots)
    out = hep.combine(y, d.handle, weights=d.weights)

The dispatch runs on the R * L physical slots with the default placement (slot p on rank
p // L), so docs/design.md §2.1 applies to them unchanged: capacity is per physical slot (each slot
the capacity a logical expert has without copies), and a dropless run gives every row the same
expert output as without replicas. `d.stats.tokens_per_expert`
stays logical; `d.stats.tokens_per_slot` counts each physical slot.

Exact gradients: the stored weights hold each logical expert once; `gather` copies a primary to
its redundant slots with `ppermute`s (one per round: each rank sends and receives at most one
expert per round) and a gather, whose autodiff transposes sum every copy's gradient into the
stored parameter.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_hybridep import checks, ops
from jax_hybridep.balance.placement import EMPTY, Placement
from jax_hybridep.config import DispatchConfig
from jax_hybridep.pytree import pytree_record
from jax_hybridep.topology import Topology
from jax_hybridep.values import check_int, check_type, is_int


@pytree_record
@dataclasses.dataclass(frozen=True)
class ReplicaStats(ops.DispatchStats):
    """DispatchStats with the logical `tokens_per_expert` [E] and, beside it,
    `tokens_per_slot` [R * L] int32: rows routed to each physical slot, before drops."""

    tokens_per_slot: jax.Array


@dataclasses.dataclass(frozen=True)
class Replicas:
    """A Placement's per-shard runtime on an EP topology (its ranks are the placement's)."""

    placement: Placement
    topology: Topology

    def __post_init__(self):
        check_type("placement", self.placement, Placement, "a balance.Placement")
        check_type("topology", self.topology, Topology, "a jax_hybridep.Topology")
        if self.placement.num_ranks != self.topology.ep_size:
            raise ValueError(
                f"the placement spans {self.placement.num_ranks} ranks but the topology "
                f"{self.topology.levels} has EP size {self.topology.ep_size}"
            )

    # -- ids --------------------------------------------------------------------------------

    def physical_config(self, config: DispatchConfig, tokens: int, top_k: int) -> DispatchConfig:
        """`config` (over logical experts) for the physical slots of a dispatch of `tokens` x
        `top_k` ids per shard. A capacity factor keeps its meaning: every physical slot gets
        the capacity a logical expert has without copies, `ceil(f * T * EP * K / E)` (§2.1.3),
        so a copied expert has a multiple of it and no expert has less (drops never rise)."""
        check_type("config", config, DispatchConfig, "a jax_hybridep.DispatchConfig")
        check_int("tokens", tokens, 1)
        check_int("top_k", top_k, 1)
        p = self.placement
        if config.num_experts != p.num_experts:
            raise ValueError(
                f"config.num_experts={config.num_experts} differs from the placement's "
                f"{p.num_experts} logical experts"
            )
        if config.expert_placement is not None or config.num_local_slots is not None:
            raise ValueError(
                "a replica Placement replaces DispatchConfig.expert_placement / num_local_slots; "
                f"got expert_placement={config.expert_placement}, "
                f"num_local_slots={config.num_local_slots}"
            )
        physical = dataclasses.replace(config, num_experts=p.num_slots)
        f, rows = config.capacity_factor, tokens * p.num_ranks * top_k
        if f is None or rows == 0:
            return physical
        wanted = f * rows / p.num_experts
        if wanted > rows:  # clamped by the dispatch plan (which warns): scale the factor
            return dataclasses.replace(physical, capacity_factor=f * p.num_slots / p.num_experts)
        # The physical plan computes ceil(f' * rows / num_slots): half a row below the logical
        # capacity, so float rounding cannot move the ceiling.
        capacity = math.ceil(wanted)
        return dataclasses.replace(physical, capacity_factor=(capacity - 0.5) * p.num_slots / rows)

    def physical_ids(self, topk_idx, rank) -> jax.Array:
        """[T, K] logical ids of source rank `rank` -> physical slots by the replica rule
        (`balance.placement`); -1 stays -1 and invalid ids become the invalid id R * L.
        `topk_idx` integer (checked in its own dtype, like dispatch's), `rank` in [0, R)."""
        p = self.placement
        topk_idx = jnp.asarray(topk_idx)
        if not jnp.issubdtype(topk_idx.dtype, jnp.integer):
            raise TypeError(f"topk_idx must hold integer expert ids, got dtype {topk_idx.dtype}")
        if topk_idx.ndim != 2:
            raise ValueError(f"topk_idx must be [T, K], got shape {topk_idx.shape}")
        if is_int(rank):
            check_int("rank", rank, 0, p.num_ranks - 1)
        count, ids = (jnp.asarray(a) for a in p.candidates)
        # Ids the int32 cast would wrap into range (wide or unsigned) count as invalid first.
        idx = checks.expert_ids_int32(topk_idx, p.num_experts)
        flat = idx.reshape(-1)
        valid = (flat >= 0) & (flat < p.num_experts)
        expert = jnp.where(valid, flat, p.num_experts)  # invalid ids sort after every expert
        # The i-th of this rank's rows for an expert, in (t, k) order: a stable sort by expert.
        order = jnp.argsort(expert, stable=True)
        ranked = expert[order]
        first = jnp.searchsorted(ranked, ranked, side="left").astype(jnp.int32)
        ordinal = jnp.zeros_like(flat).at[order].set(jnp.arange(flat.size, dtype=jnp.int32) - first)
        node = rank // (p.ranks_per_node or p.num_ranks)
        safe = jnp.minimum(expert, p.num_experts - 1)
        n = count[node, safe]
        slot = ids[node, safe, (ordinal + rank) % n]
        out = jnp.where(valid, slot, jnp.where(flat == -1, -1, p.num_slots))
        return out.reshape(idx.shape)

    @functools.cached_property
    def slot_logical(self) -> np.ndarray:
        """[R * L] logical expert of each physical slot (EMPTY where none)."""
        return self.placement.table.reshape(-1)

    def logical_counts(self, tokens_per_slot) -> jax.Array:
        """[R * L] per-slot counts -> [E] per logical expert."""
        if jnp.shape(tokens_per_slot) != (self.placement.num_slots,):
            raise ValueError(
                f"tokens_per_slot must be [R * L] = [{self.placement.num_slots}], got shape "
                f"{jnp.shape(tokens_per_slot)}"
            )
        e = self.placement.num_experts
        owner = jnp.asarray(np.where(self.slot_logical == EMPTY, e, self.slot_logical))
        return jax.ops.segment_sum(tokens_per_slot, owner, num_segments=e + 1)[:e]

    # -- per shard ----------------------------------------------------------------------------

    def _rank(self):
        return jax.lax.axis_index(self.topology.ep_axes).astype(jnp.int32)

    def dispatch(self, x, topk_idx, topk_weights, *, config: DispatchConfig) -> ops.Dispatched:
        """`hep.dispatch` with logical `topk_idx` (config over the logical experts); the
        result's rows, group sizes and handle are the physical slots'."""
        physical = self.physical_config(config, *np.shape(topk_idx))
        ids = self.physical_ids(topk_idx, self._rank())
        d = ops.dispatch(x, ids, topk_weights, topology=self.topology, config=physical)
        per_slot = d.stats.tokens_per_expert
        stats = ReplicaStats(
            d.stats.dropped,
            d.stats.invalid,
            self.logical_counts(per_slot),
            d.stats.level_rows,
            per_slot,
        )
        return dataclasses.replace(d, stats=stats)

    @functools.cached_property
    def rounds(self) -> tuple[tuple[tuple[int, int, int, int], ...], ...]:
        """Remote replica copies as rounds of (source rank, source slot, rank, slot), each
        rank sending and receiving at most once per round (a greedy edge colouring)."""
        busy_send: dict[int, set[int]] = {}
        busy_recv: dict[int, set[int]] = {}
        rounds: list[list[tuple[int, int, int, int]]] = []
        for rank, slot, src, src_slot in self.placement.replica_sources:
            if rank == src:
                continue
            c = 0
            while c in busy_send.get(src, ()) or c in busy_recv.get(rank, ()):
                c += 1
            busy_send.setdefault(src, set()).add(c)
            busy_recv.setdefault(rank, set()).add(c)
            while len(rounds) <= c:
                rounds.append([])
            rounds[c].append((src, src_slot, rank, slot))
        return tuple(tuple(r) for r in rounds)

    def gather(self, weights: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
        """Inside `jax.shard_map`: stored [E/R, ...] each -> [L, ...] each, slot order of the
        placement (empty slots zero)."""
        p = self.placement
        lp, r = p.slots_per_rank, p.num_ranks
        if not isinstance(weights, Sequence):  # an array would be split into its rows
            raise TypeError(
                f"gather takes a sequence of stored expert arrays, got {type(weights).__name__}"
                " (wrap one array in a tuple)"
            )
        weights = tuple(weights)
        for w in weights:
            if jnp.ndim(w) == 0 or jnp.shape(w)[0] != lp:
                raise ValueError(
                    f"gather expects [{lp}, ...] stored experts per shard, got shape {jnp.shape(w)}"
                )
        if p.redundant_per_rank == 0:
            return weights
        rank = self._rank()
        rounds = self.rounds
        # Per rank and redundant slot: where its value comes from in
        # [stored (lp), received in round 0..C-1, zeros].
        source = np.full((r, p.redundant_per_rank), lp + len(rounds), np.int32)
        for rank_, slot, src, src_slot in p.replica_sources:
            if rank_ == src:
                source[rank_, slot - lp] = src_slot
        sends = []
        for c, edges in enumerate(rounds):
            send_slot = np.zeros(r, np.int32)
            for src, src_slot, dst, slot in edges:
                send_slot[src] = src_slot
                source[dst, slot - lp] = lp + c
            sends.append((jnp.asarray(send_slot), [(src, dst) for src, _, dst, _ in edges]))
        pick = jnp.asarray(source)[rank]
        out = []
        for w in weights:
            received = [
                jax.lax.ppermute(w[send_slot[rank]], self.topology.ep_axes, perm)
                for send_slot, perm in sends
            ]
            pool = jnp.concatenate([w, *(v[None] for v in received), jnp.zeros_like(w[:1])])
            out.append(jnp.concatenate([w, pool[pick]]))
        return tuple(out)
