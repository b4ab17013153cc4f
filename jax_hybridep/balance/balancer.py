"""The balancer: a `Placement` from measured expert load (numpy, deterministic).

`plan_placement` follows the shape of DeepSeek-V3's EPLB (our own code): give the extra copies
to the experts with the most load per copy, spread every expert's copies over nodes so each
node's received load is balanced (each copy to the node with the fewest of that expert among
nodes with a free redundant slot), then pack each node's copies into its ranks, heaviest first
onto the least loaded rank with room in the copy's class (primaries into primary slots, copies
into redundant ones), and improve by swapping pairs between the most loaded rank and the others.
Copy weights follow the replica rule exactly (`Placement.slot_loads`). It tries every number of
copies (up to `MAX_BUDGETS` of them) and keeps the lowest predicted cost; among candidates
within `NEAR_EQUAL` of it (and no costlier than plain EP), the one with the most copies (the
prediction assumes every rank sends an equal share of each expert; real batches do not, and more
copies absorb more of that).

Every plan keeps two placement rules (`spread_violations` checks them):

* a rank never holds two instances (primary or copies) of one expert: a copy whose node has no
  free redundant slot on a rank without that expert is left out, its slot stays for others;
* an expert's instances are spread over nodes: when node u holds at least two more of them
  than node v, no rank of v without that expert has a free redundant slot.

Replicas are not free: each remote copy's weights travel to it every step and its gradient
back. With `expert_bytes` and `row_bytes` the balancer charges that: a rank's cost is its rows
plus the replica bytes it receives divided by the bytes a row moves per step, and it uses only
as many redundant slots as lower the largest cost (the others stay empty).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jax_hybridep.balance.placement import EMPTY, Placement, imbalance
from jax_hybridep.values import check_array, check_int, check_real, check_type

MAX_BUDGETS = 33  # replica counts tried per plan (all of them up to this many)
SWAP_ROUNDS = 64  # swap-improvement passes per rank and slot
# Candidates whose predicted cost is within this fraction of the lowest count as equal; among
# them the plan with the most copies wins: on docs/balance.md's workloads (§5) their predicted
# max/mean differ by < 0.001, and on held-out batches the most copies measured 0.003-0.007
# lower than the fewest (any value from 0.002 to 0.02 picks the same plans there).
NEAR_EQUAL = 0.005


@dataclasses.dataclass(frozen=True)
class BalancePlan:
    """What `plan_placement` returns.

    Attributes:
      placement: the new placement (`current` itself when it was kept).
      before, after: predicted max/mean per-rank load under `current` (plain EP when None)
        and under `placement`.
      rank_load: [R] predicted rows per rank under `placement`.
      sync_bytes: [R] replica-sync bytes each rank receives per step under `placement`
        (0 without `expert_bytes`); their sum is 2 x expert bytes x remote replicas.
      moved_experts: logical experts whose primary (stored weights and optimiser state) moves
        to another rank.
      changed: whether `placement` differs from `current`.
    """

    placement: Placement
    before: float
    after: float
    rank_load: tuple[float, ...]
    sync_bytes: tuple[int, ...]
    moved_experts: int
    changed: bool


def plan_placement(
    load,
    num_ranks: int,
    slots_per_rank: int,
    redundant_per_rank: int,
    ranks_per_node: int | None = None,
    *,
    current: Placement | None = None,
    expert_bytes: int = 0,
    row_bytes: int = 0,
    min_gain: float = 0.02,
) -> BalancePlan:
    """A placement of `len(load)` logical experts with (near) the lowest largest per-rank load
    (among plans within `NEAR_EQUAL` of it, the one with the most copies; module docstring).

    Args:
      load: [E] non-negative expected rows per expert per step, e.g. a moving average of
        `stats.tokens_per_expert` (`moving_average`).
      num_ranks: R, ranks of the EP group.
      slots_per_rank: primary slots per rank; E must be R * slots_per_rank.
      redundant_per_rank: redundant slots per rank (copies of hot experts).
      ranks_per_node: ranks per node (the fastest level); balanced per node first, and the
        replica rule prefers a copy on the sender's node. None: one node.
      current: the placement in use; the plan keeps it (changed=False) unless the new one's
        largest cost is lower by more than `min_gain` (a fraction), so a placement changes, and
        a step recompiles, only for a real gain.
      expert_bytes, row_bytes: bytes of one expert's weights and bytes one routed row moves per
        step; when both are > 0 the replica sync is charged (module docstring).

    Returns:
      BalancePlan.
    """
    load = check_array("load", load, ndim=1, lo=0)
    r = check_int("num_ranks", num_ranks, 1)
    lp = check_int("slots_per_rank", slots_per_rank, 1)
    n = check_int("redundant_per_rank", redundant_per_rank, 0)
    if load.size != r * lp:
        raise ValueError(
            f"load has {load.size} experts but num_ranks={r} x slots_per_rank={lp} = {r * lp} "
            "primary slots (each logical expert has exactly one)"
        )
    per_node = r if ranks_per_node is None else check_int("ranks_per_node", ranks_per_node, 1)
    if r % per_node:
        raise ValueError(f"ranks_per_node={per_node} does not divide num_ranks={r}")
    check_int("expert_bytes", expert_bytes, 0)
    check_int("row_bytes", row_bytes, 0)
    check_real("min_gain", min_gain, 0.0, 1.0, below_hi=True)
    if current is not None:
        check_type("current", current, Placement, "a balance.Placement or None")
    if current is not None and (
        current.num_ranks,
        current.slots_per_rank,
        current.redundant_per_rank,
    ) != (r, lp, n):
        raise ValueError(
            f"current placement has {current.num_ranks} ranks x ({current.slots_per_rank} + "
            f"{current.redundant_per_rank}) slots, not {r} x ({lp} + {n})"
        )

    def cost(placement):
        rows = placement.rank_loads(load)
        if expert_bytes and row_bytes:
            rows = rows + placement.sync_bytes(expert_bytes) / row_bytes
        return float(rows.max())

    budgets = range(r * n + 1)
    if len(budgets) > MAX_BUDGETS:
        budgets = sorted(set(np.linspace(0, r * n, MAX_BUDGETS).round().astype(int).tolist()))
    base = current or Placement.default(load.size, r, n, ranks_per_node)
    # Plain EP's order competes too: a plan is never predicted worse than it.
    candidates = [Placement.default(load.size, r, n, ranks_per_node)]
    for used in budgets:
        table = _place(load, r, lp, n, per_node, used)
        candidates.append(Placement(tuple(map(tuple, table)), lp, ranks_per_node))
    costs = [cost(c) for c in candidates]
    lowest = min(costs)
    # Near-equal never reaches above plain EP's cost (candidate 0): a few more copies are not
    # worth a plan predicted worse than no plan.
    near = [i for i, c in enumerate(costs) if c <= min(lowest * (1 + NEAR_EQUAL), costs[0])]
    # The most copies among the near-equal; then the lower cost; then the earlier candidate.
    pick = min(near, key=lambda i: (-_copies(candidates[i]), costs[i], i))
    best, best_cost = candidates[pick], costs[pick]
    if current is not None and not best_cost < cost(current) * (1 - min_gain):
        best = current
    rank_load = best.rank_loads(load)
    moved = int(np.sum(base.storage_index // lp != best.storage_index // lp))
    return BalancePlan(
        placement=best,
        before=imbalance(base.rank_loads(load)),
        after=imbalance(rank_load),
        rank_load=tuple(float(v) for v in rank_load),
        sync_bytes=tuple(int(v) for v in best.sync_bytes(expert_bytes)),
        moved_experts=moved,
        changed=current is None or best != current,
    )


def spread_violations(placement: Placement) -> list[str]:
    """The placement rules of the module docstring that `placement` breaks (empty: none)."""
    table = placement.table
    lp, per_node = placement.slots_per_rank, placement.num_ranks // placement.nodes
    out = []
    for rank, row in enumerate(table):
        experts, times = np.unique(row[row != EMPTY], return_counts=True)
        for e, k in zip(experts[times > 1], times[times > 1], strict=True):
            out.append(f"rank {rank} holds expert {int(e)} {int(k)} times")
    for e in range(placement.num_experts):
        on_node = (table == e).reshape(placement.nodes, -1).sum(axis=1)
        for u, v in np.argwhere(on_node[:, None] >= on_node[None, :] + 2):
            ranks = table[v * per_node : (v + 1) * per_node]
            if any(np.any(rk[lp:] == EMPTY) and not np.any(rk == e) for rk in ranks):
                out.append(
                    f"node {u} holds {on_node[u]} instances of expert {e}, node {v} "
                    f"{on_node[v]} with a free redundant slot on a rank without it"
                )
    return out


def _copies(placement: Placement) -> int:
    return int(np.sum(placement.table[:, placement.slots_per_rank :] != EMPTY))


def moving_average(previous, tokens_per_expert, decay: float):
    """`decay * previous + (1 - decay) * tokens_per_expert` (float64); `previous` None starts
    the average at the first measurement. Both [E], finite and >= 0; decay in [0, 1)."""
    decay = check_real("decay", decay, 0.0, 1.0, below_hi=True)
    new = check_array("tokens_per_expert", tokens_per_expert, ndim=1, lo=0)
    if previous is None:
        return new
    previous = check_array("previous", previous, ndim=1, lo=0)
    if previous.shape != new.shape:
        raise ValueError(
            f"previous has {previous.size} experts but tokens_per_expert has {new.size}"
        )
    return decay * previous + (1 - decay) * new


def _replica_counts(load, num_ranks, used) -> np.ndarray:
    """Copies per expert: one each, then `used` more, each to the most load per copy."""
    count = np.ones(load.size, np.int64)
    for _ in range(used):
        per_copy = np.where(count < num_ranks, load / count, -np.inf)
        e = int(np.argmax(per_copy))  # ties: the lowest id
        if per_copy[e] == -np.inf:
            break
        count[e] += 1
    return count


def _node_copies(load, count, nodes, per_node, lp, n) -> list[list[int]]:
    """Per expert, the node of each copy (the primary's first)."""
    if nodes == 1:
        return [[0] * int(c) for c in count]
    room_p, room_r = [per_node * lp] * nodes, [per_node * n] * nodes
    node_load = np.zeros(nodes)
    out: list[list[int]] = [[] for _ in count]
    for e in sorted(range(load.size), key=lambda e: (-load[e] / count[e], e)):
        c = int(count[e])
        spread = c >= nodes  # a copy on every node: each node then receives load / nodes
        primary = min((v for v in range(nodes) if room_p[v]), key=lambda v: (node_load[v], v))
        room_p[primary] -= 1
        held = [0] * nodes
        held[primary] = 1
        out[e].append(primary)
        for _ in range(c - 1):
            free = [v for v in range(nodes) if room_r[v]]
            v = min(free, key=lambda v: (held[v], 0 if spread else node_load[v], -room_r[v], v))
            room_r[v] -= 1
            held[v] += 1
            out[e].append(v)
        if spread:
            node_load += load[e] / nodes
        else:
            for v in out[e]:
                node_load[v] += load[e] / c
    return out


def _place(load, num_ranks, lp, n, per_node, used) -> np.ndarray:
    """[R, lp + n] slot table with `used` extra copies."""
    nodes = num_ranks // per_node
    count = _replica_counts(load, num_ranks, used)
    node_of = _node_copies(load, count, nodes, per_node, lp, n)
    table = np.full((num_ranks, lp + n), EMPTY, np.int64)
    for node in range(nodes):
        items = []  # (weight, expert, primary?)
        for e, where in enumerate(node_of):
            here = where.count(node)
            if not here:
                continue
            covered = len(set(where))
            weight = load[e] / nodes / here + load[e] * (nodes - covered) / nodes / len(where)
            for i, v in enumerate(where):
                if v == node:
                    items.append((weight, e, i == 0))
        ranks = _pack(items, per_node, lp, n)
        for local, held in enumerate(ranks):
            rank = node * per_node + local
            primaries = sorted(e for _, e, p in held if p and e != EMPTY)
            copies = sorted(e for _, e, p in held if not p and e != EMPTY)
            table[rank, :lp] = primaries
            table[rank, lp : lp + len(copies)] = copies
    _even_out_nodes(table, lp, per_node)
    return table


def _even_out_nodes(table, lp, per_node) -> None:
    """Moves copies (in place) from a node holding two or more instances of an expert more
    than another node to a free redundant slot there, on a rank without that expert (the
    second placement rule; a copy left out by `_pack` can free such a slot)."""
    nodes = table.shape[0] // per_node
    if nodes == 1:
        return
    by_node = table.reshape(nodes, per_node, -1)  # a view: writes go to `table`
    for e in range(table.shape[0] * lp):
        while True:
            on_node = (by_node == e).sum(axis=(1, 2))
            takers = [v for v in range(nodes) if _free_rank(by_node[v], e, lp) is not None]
            if not takers:
                break
            v = min(takers, key=lambda v: (on_node[v], v))
            u = int(np.argmax(on_node))  # the lowest id among the most
            if on_node[u] < on_node[v] + 2:
                break
            rank, slot = np.argwhere(by_node[u][:, lp:] == e)[-1]
            by_node[u][rank, lp + slot] = EMPTY
            to = _free_rank(by_node[v], e, lp)
            free_slot = lp + int(np.flatnonzero(by_node[v][to, lp:] == EMPTY)[0])
            by_node[v][to, free_slot] = e


def _free_rank(ranks, e, lp) -> int | None:
    """The first of `ranks` ([per_node, L]) without expert e and with a free redundant slot."""
    for i, row in enumerate(ranks):
        if not np.any(row == e) and np.any(row[lp:] == EMPTY):
            return i
    return None


def _pack(items, ranks, lp, n) -> list[list[tuple[float, int, bool]]]:
    """Items into `ranks` ranks of lp primary and n redundant slots: heaviest first onto the
    least loaded rank with room in its class that does not hold the item's expert (a copy with
    no such rank is left out), then swaps between the most loaded rank and the others while one
    lowers the larger of the two (never bringing an expert onto a rank that holds it)."""
    held: list[list[tuple[float, int, bool]]] = [[] for _ in range(ranks)]
    room = [[n, lp] for _ in range(ranks)]  # [redundant, primary] left
    load = np.zeros(ranks)
    for w, e, p in sorted(items, key=lambda it: (-it[0], it[1], not it[2])):
        free = [r for r in range(ranks) if room[r][p]]
        fresh = [r for r in free if all(x != e for _, x, _ in held[r])]
        if not fresh:  # only a copy can meet its expert (the primary comes first): left out
            continue
        r = min(fresh, key=lambda r: (load[r], r))
        held[r].append((w, e, p))
        room[r][p] -= 1
        load[r] += w
    for r in range(ranks):  # empty redundant slots take part in swaps as weight-0 items
        held[r] += [(0.0, EMPTY, False)] * room[r][0]
    for _ in range(SWAP_ROUNDS * ranks * (lp + n)):
        a = int(np.argmax(load))
        best = None
        for b in range(ranks):
            if b == a:
                continue
            experts_a = {x for _, x, _ in held[a]} - {EMPTY}
            experts_b = {x for _, x, _ in held[b]} - {EMPTY}
            for i, (wi, ei, pi) in enumerate(held[a]):
                for j, (wj, ej, pj) in enumerate(held[b]):
                    if pi != pj or wi <= wj or (ei in experts_b) or (ej in experts_a):
                        continue
                    top = max(load[a] - wi + wj, load[b] - wj + wi)
                    if top < load[a] * (1 - 1e-12) and (best is None or top < best[0]):
                        best = (top, b, i, j)
        if best is None:
            break
        _, b, i, j = best
        held[a][i], held[b][j] = held[b][j], held[a][i]
        load[a] += held[a][i][0] - held[b][j][0]
        load[b] += held[b][j][0] - held[a][i][0]
    return held
