"""Where logical experts live when hot ones have redundant copies (numpy, static).

A `Placement` gives each of R ranks `slots_per_rank` primary slots and `redundant_per_rank`
redundant ones; physical slot p = rank * L + slot, L = slots_per_rank + redundant_per_rank.
The primary slots hold every logical expert exactly once (a permutation: the order the stacked
expert parameters are stored in, E / R per rank, so the optimiser, clipping and checkpoints see
each logical parameter once); a redundant slot holds a copy of some expert, fetched from its
primary every step, or is empty (-1).

The replica rule (which copy a routed row goes to, `Placement.candidates`): a row from source
rank r for expert e goes to one of e's copies on r's node if there is any, else to any copy;
among those candidates, the i-th of rank r's rows for e (in (t, k) order) takes candidate
`(i + r) mod count`, so each rank splits its rows evenly and the remainders rotate over ranks.
`rank_loads` predicts each rank's rows under that rule when every rank sends an equal share of
each expert's load (tokens spread evenly over ranks, as data-parallel batches are).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from jax_hybridep.topology import Topology
from jax_hybridep.values import check_array, check_int, check_type

EMPTY = -1  # an unused redundant slot


@dataclasses.dataclass(frozen=True)
class Placement:
    """Logical expert of every physical slot (see the module docstring).

    Attributes:
      slot_expert: [R][L] logical expert id of each (rank, slot); slots < slots_per_rank are
        primary (each expert exactly once), the others redundant copies or EMPTY.
      slots_per_rank: primary slots per rank (E / R).
      ranks_per_node: ranks per node for the replica rule's "sender's node first"; None: one node.
    """

    slot_expert: tuple[tuple[int, ...], ...]
    slots_per_rank: int
    ranks_per_node: int | None = None

    def __post_init__(self):
        try:
            table = np.asarray(self.slot_expert)
        except ValueError:
            table = np.empty((0,))
        if table.ndim != 2 or table.size == 0 or not np.issubdtype(table.dtype, np.integer):
            raise ValueError(
                f"slot_expert must be a non-empty [ranks][slots] table of ints, got "
                f"{self.slot_expert!r}"
            )
        lp = check_int("slots_per_rank", self.slots_per_rank, 1)
        num_ranks, slots = table.shape
        if slots < lp:
            raise ValueError(
                f"slot_expert has {slots} slots per rank, fewer than slots_per_rank={lp}"
            )
        num_experts = num_ranks * lp
        primary = np.sort(table[:, :lp].reshape(-1))
        if not np.array_equal(primary, np.arange(num_experts)):
            raise ValueError(
                f"the primary slots (the first {lp} of each rank) must hold every logical expert "
                f"0..{num_experts - 1} exactly once, got {table[:, :lp].tolist()}"
            )
        redundant = table[:, lp:]
        if np.any((redundant < EMPTY) | (redundant >= num_experts)):
            raise ValueError(
                f"redundant slots must hold an expert id in [0, {num_experts}) or {EMPTY} "
                f"(empty), got {redundant.tolist()}"
            )
        if self.ranks_per_node is not None:
            p = check_int("ranks_per_node", self.ranks_per_node, 1)
            if num_ranks % p:
                raise ValueError(f"ranks_per_node={p} does not divide the {num_ranks} ranks")
            object.__setattr__(self, "ranks_per_node", p)
        object.__setattr__(self, "slot_expert", tuple(tuple(int(v) for v in row) for row in table))
        object.__setattr__(self, "slots_per_rank", lp)

    # -- construction and serialisation ---------------------------------------------------

    @classmethod
    def default(
        cls,
        num_experts: int,
        num_ranks: int,
        redundant_per_rank: int = 0,
        ranks_per_node: int | None = None,
    ) -> Placement:
        """Expert e's primary at (e // E_local, e % E_local), as plain EP; redundant slots empty."""
        check_int("num_experts", num_experts, 1)
        check_int("num_ranks", num_ranks, 1)
        check_int("redundant_per_rank", redundant_per_rank, 0)
        if num_experts % num_ranks:
            raise ValueError(f"num_experts={num_experts} is not divisible by {num_ranks} ranks")
        lp = num_experts // num_ranks
        table = np.full((num_ranks, lp + redundant_per_rank), EMPTY)
        table[:, :lp] = np.arange(num_experts).reshape(num_ranks, lp)
        return cls(tuple(map(tuple, table)), lp, ranks_per_node)

    @classmethod
    def for_topology(cls, num_experts: int, topology, redundant_per_rank: int = 0) -> Placement:
        """`default` on a `Topology`'s EP group; with several levels, a node is the fastest
        level's ranks (the replica rule prefers a copy there)."""
        check_type("topology", topology, Topology, "a jax_hybridep.Topology")
        per_node = topology.level_sizes[-1] if len(topology.levels) > 1 else None
        return cls.default(num_experts, topology.ep_size, redundant_per_rank, per_node)

    def to_json(self) -> dict:
        return dict(
            slot_expert=[list(r) for r in self.slot_expert],
            slots_per_rank=self.slots_per_rank,
            ranks_per_node=self.ranks_per_node,
        )

    @classmethod
    def from_json(cls, data: dict) -> Placement:
        check_type("data", data, dict, "a dict from Placement.to_json")
        try:
            return cls(
                tuple(tuple(r) for r in data["slot_expert"]),
                data["slots_per_rank"],
                data.get("ranks_per_node"),
            )
        except (KeyError, TypeError) as err:
            raise ValueError(f"not a saved Placement: {data!r} ({err})") from None

    # -- geometry ---------------------------------------------------------------------------

    @property
    def num_ranks(self) -> int:
        return len(self.slot_expert)

    @property
    def slots(self) -> int:
        """L: physical slots per rank (primary + redundant)."""
        return len(self.slot_expert[0])

    @property
    def redundant_per_rank(self) -> int:
        return self.slots - self.slots_per_rank

    @property
    def num_experts(self) -> int:
        return self.num_ranks * self.slots_per_rank

    @property
    def num_slots(self) -> int:
        """R * L physical slots (the `num_experts` the dispatch runs with)."""
        return self.num_ranks * self.slots

    @property
    def nodes(self) -> int:
        return self.num_ranks // (self.ranks_per_node or self.num_ranks)

    @functools.cached_property
    def table(self) -> np.ndarray:
        """[R, L] int32 slot_expert."""
        return np.asarray(self.slot_expert, np.int32)

    @functools.cached_property
    def storage_order(self) -> np.ndarray:
        """[E]: the logical expert at storage index r * slots_per_rank + s (the primaries)."""
        return self.table[:, : self.slots_per_rank].reshape(-1)

    @functools.cached_property
    def storage_index(self) -> np.ndarray:
        """[E]: where logical expert e is stored (the inverse of storage_order)."""
        index = np.empty(self.num_experts, np.int64)
        index[self.storage_order] = np.arange(self.num_experts)
        return index

    def copies(self, expert: int) -> tuple[int, ...]:
        """Physical slots (rank * L + slot, ascending) holding `expert`."""
        check_int("expert", expert, 0, self.num_experts - 1)
        return tuple(int(p) for p in np.flatnonzero(self.table.reshape(-1) == expert))

    @functools.cached_property
    def replica_sources(self) -> tuple[tuple[int, int, int, int], ...]:
        """Per occupied redundant slot, (rank, slot, source rank, source primary slot)."""
        out = []
        lp = self.slots_per_rank
        for rank, row in enumerate(self.slot_expert):
            for slot in range(lp, self.slots):
                expert = row[slot]
                if expert != EMPTY:
                    src = int(self.storage_index[expert])
                    out.append((rank, slot, src // lp, src % lp))
        return tuple(out)

    @property
    def remote_replicas(self) -> int:
        """Redundant copies whose primary is on another rank (each costs a sync every step)."""
        return sum(r != src for r, _, src, _ in self.replica_sources)

    def sync_bytes(self, expert_bytes: int) -> np.ndarray:
        """[R] bytes each rank receives per training step for the replicas: a copy's weights
        (forward, at the copy's rank) and its gradient (backward, at the primary's rank)."""
        check_int("expert_bytes", expert_bytes, 0)
        out = np.zeros(self.num_ranks, np.int64)
        for rank, _, src, _ in self.replica_sources:
            if rank != src:
                out[rank] += expert_bytes
                out[src] += expert_bytes
        return out

    # -- the replica rule -------------------------------------------------------------------

    @functools.cached_property
    def candidates(self) -> tuple[np.ndarray, np.ndarray]:
        """(count [nodes, E], ids [nodes, E, max count]) int32: per source node and logical
        expert, the physical slots its rows may go to (ascending; padded with the first)."""
        per_node = self.num_ranks // self.nodes
        flat = self.table.reshape(-1)
        lists = [[[] for _ in range(self.num_experts)] for _ in range(self.nodes)]
        for node in range(self.nodes):
            lo, hi = node * per_node * self.slots, (node + 1) * per_node * self.slots
            for e in range(self.num_experts):
                every = np.flatnonzero(flat == e)
                near = every[(every >= lo) & (every < hi)]
                lists[node][e] = (near if near.size else every).tolist()
        width = max(len(c) for per in lists for c in per)
        count = np.asarray([[len(c) for c in per] for per in lists], np.int32)
        ids = np.asarray([[c + [c[0]] * (width - len(c)) for c in per] for per in lists], np.int32)
        return count, ids

    def slot_loads(self, load) -> np.ndarray:
        """[R, L] predicted rows per physical slot when every rank sends load[e] / R of
        expert e's rows (the replica rule above, remainders ignored); load [E] finite, >= 0."""
        load = check_array("load", load, ndim=1, lo=0)
        if load.size != self.num_experts:
            raise ValueError(f"load has {load.size} experts, the placement {self.num_experts}")
        count, ids = self.candidates
        out = np.zeros(self.num_slots)
        for node in range(self.nodes):
            share = load / self.nodes / count[node]  # per candidate, from this node's senders
            for j in range(ids.shape[2]):
                take = j < count[node]
                np.add.at(out, ids[node, take, j], share[take])
        return out.reshape(self.num_ranks, self.slots)

    def rank_loads(self, load) -> np.ndarray:
        """[R] predicted rows each rank receives (see `slot_loads`)."""
        return self.slot_loads(load).sum(axis=1)


def imbalance(rank_load) -> float:
    """max / mean of per-rank loads (1.0 when balanced, and when nothing is routed); rank_load
    [R] finite, >= 0."""
    rank_load = check_array("rank_load", rank_load, ndim=1, lo=0)
    mean = rank_load.mean()
    return float(rank_load.max() / mean) if mean > 0 else 1.0


def permutation(old: Placement, new: Placement) -> np.ndarray:
    """Index array `perm` with `stored_new = stored_old[perm]` along the expert dim (moves the
    stacked expert weights, and any state shaped like them, to `new`'s storage order)."""
    check_type("old", old, Placement, "a balance.Placement")
    check_type("new", new, Placement, "a balance.Placement")
    if old.num_experts != new.num_experts:
        raise ValueError(
            f"placements of {old.num_experts} and {new.num_experts} experts cannot be swapped"
        )
    return old.storage_index[new.storage_order]
