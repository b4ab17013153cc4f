"""Flow-level network model: max-min fair sharing (progressive filling), event-driven completion.

A network is a set of *link classes*: `multiplicity[l]` identical links of `capacity[l]` bytes/s.
Traffic is a set of *flow groups*: `count[f]` flows of `size[f]` bytes each, starting at
`start[f]` seconds, every flow crossing one link of each class in its path class `paths[path[f]]`.

Aggregation is exact when the traffic is symmetric: if every group spreads its flows evenly over
the links of each class (each link of class l carries `count[f] / multiplicity[l]` flows of group
f), the unique max-min fair allocation gives every flow of a path class the same rate, and the
aggregated progressive filling below computes it. The same code with one link per class and one
flow per group is the plain, unaggregated model (`tests/sim_test.py` checks the two agree).

Two engines share `max_min_rates`:
* `simulate` (used everywhere): per path class a virtual clock `V[k]` (bytes served to any one flow
  of the class so far); a group finishes when `V` reaches its tag `V(start) + size`, as in fair
  queueing. Each event costs a water-filling over the *path classes* (a handful), not the groups,
  so 1000 DCs x 8 GPUs (8000 groups per all-to-all) takes a fraction of a second.
* `simulate_reference`: remaining bytes per group, water-filling over groups; plain and slow,
  for tests.
"""

from __future__ import annotations

import dataclasses
import heapq

import numpy as np

from jax_hybridep.values import check_array, check_real, check_type, short

# Relative slack for "this link is full" and "this flow is done": the event loop accumulates
# float sums, so exact equality would miss simultaneous events by one ulp.
_TOL = 1e-9


@dataclasses.dataclass(frozen=True)
class Network:
    """Link classes.

    Attributes:
      capacity: (L,) bytes/s of one link of each class.
      multiplicity: (L,) number of identical links in each class.
      names: L labels, for reports.
      congestible: (L,) bool or None (all), the classes `Congestion` applies to (WAN links;
        not the GPU's PCIe/NVLink side, which no window-based transport drives).
    """

    capacity: np.ndarray
    multiplicity: np.ndarray
    names: tuple[str, ...]
    congestible: np.ndarray | None = None

    def __post_init__(self):
        cap = check_array("Network.capacity", self.capacity, ndim=1)
        mult = check_array("Network.multiplicity", self.multiplicity, ndim=1)
        names = self.names
        if isinstance(names, str) or not all(isinstance(n, str) for n in names):
            raise TypeError(f"Network.names must be a sequence of str, got {short(names)}")
        if cap.shape != mult.shape or len(names) != cap.shape[0]:
            raise ValueError(
                f"capacity {cap.shape}, multiplicity {mult.shape} and {len(names)} names "
                "must all have one entry per link class"
            )
        if (cap <= 0).any() or (mult <= 0).any():
            raise ValueError(f"link capacities and multiplicities must be > 0, got {cap}, {mult}")
        cong = np.ones(cap.shape, bool) if self.congestible is None else self.congestible
        if np.shape(cong) != cap.shape:
            raise ValueError(f"congestible has shape {np.shape(cong)}, expected {cap.shape}")
        if np.asarray(cong).dtype != bool:
            raise TypeError(f"Network.congestible must be bools, got {short(cong)}")
        object.__setattr__(self, "names", tuple(names))
        object.__setattr__(self, "capacity", cap)
        object.__setattr__(self, "multiplicity", mult)
        object.__setattr__(self, "congestible", np.asarray(cong, dtype=bool))


@dataclasses.dataclass(frozen=True)
class Flows:
    """Flow groups.

    Attributes:
      paths: (K, L) bool, the link classes a flow of path class k crosses (one link of each).
      path: (F,) int, each group's path class.
      count: (F,) flows in each group.
      size: (F,) bytes of each flow.
      start: (F,) seconds at which the group's flows start sending.
      tag: (F,) int label of the traffic a group belongs to (e.g. tokens vs. gradients), so that
        callers can read each part's completion time out of one joint simulation.
      floor: (K,) or None, the per-flow rate below which a flow of path class k congests (see
        `Congestion`), bytes/s.
    """

    paths: np.ndarray
    path: np.ndarray
    count: np.ndarray
    size: np.ndarray
    start: np.ndarray
    tag: np.ndarray
    floor: np.ndarray | None = None

    def __post_init__(self):
        path = check_array("Flows.path", self.path, ndim=1, integer=True, lo=0, nonempty=False)
        n = path.shape[0]
        fields = dict(
            count=check_array("Flows.count", self.count, ndim=1, nonempty=False),
            size=check_array("Flows.size", self.size, ndim=1, lo=0, nonempty=False),
            start=check_array("Flows.start", self.start, ndim=1, lo=0, nonempty=False),
            tag=check_array("Flows.tag", self.tag, ndim=1, integer=True, nonempty=False),
        )
        for name, value in fields.items():
            if value.shape != (n,):
                raise ValueError(
                    f"Flows.{name} has shape {value.shape}, expected ({n},) like Flows.path"
                )
        if (fields["count"] <= 0).any():
            raise ValueError(f"Flows.count must be > 0 (flows per group), got {short(self.count)}")
        paths = np.asarray(self.paths)
        if paths.dtype != bool:
            raise TypeError(f"Flows.paths must be a (K, L) bool array, got dtype {paths.dtype}")
        if paths.ndim != 2 or not paths.any(axis=1).all():
            raise ValueError(f"every path class must cross at least one link, paths={paths}")
        if n and path.max() >= paths.shape[0]:
            raise ValueError(f"Flows.path names class {path.max()}, there are {paths.shape[0]}")
        if self.floor is not None:
            floor = check_array("Flows.floor", self.floor, ndim=1, lo=0)
            if floor.shape != (paths.shape[0],):
                raise ValueError(
                    f"Flows.floor has shape {floor.shape}, expected ({paths.shape[0]},), one per "
                    "path class"
                )
            object.__setattr__(self, "floor", floor)
        object.__setattr__(self, "paths", paths)
        object.__setattr__(self, "path", path)
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    @staticmethod
    def concat(parts: list[Flows]) -> Flows:
        """One flow set holding all groups of `parts` (path classes merged, duplicates removed)."""
        if not isinstance(parts, list | tuple) or not parts:
            raise ValueError(f"parts must be a non-empty list of Flows, got {short(parts)}")
        for p in parts:
            check_type("parts[i]", p, Flows, "a sim.Flows")
        if len({p.floor is None for p in parts}) > 1:
            raise ValueError("parts must all have a floor or all have none")
        paths, inverse = np.unique(
            np.concatenate([p.paths for p in parts]), axis=0, return_inverse=True
        )
        offsets = np.cumsum([0] + [p.paths.shape[0] for p in parts])
        path = np.concatenate(
            [inverse.ravel()[o + p.path] for o, p in zip(offsets[:-1], parts, strict=True)]
        )
        cat = {
            k: np.concatenate([getattr(p, k) for p in parts])
            for k in ("count", "size", "start", "tag")
        }
        floor = None
        if parts[0].floor is not None:
            floor = np.zeros(paths.shape[0])
            floor[inverse.ravel()] = np.concatenate([p.floor for p in parts])
        return Flows(paths=paths, path=path, floor=floor, **cat)


@dataclasses.dataclass(frozen=True)
class Congestion:
    """Goodput lost on links that carry more flows than their minimum windows allow.

    A window-based transport cannot send less than about one segment per round trip, so a flow
    has a floor rate `Flows.floor` (min window / RTT). When the floors of the flows on a link add
    up to more than its capacity, the fair share is below what the transport can hold: packets
    drop, tiny windows turn losses into timeouts. We model the result as a capacity
    `C * min(1, C / sum(floors)) ** exponent`: exponent 0 is ideal sharing, larger is a
    steeper collapse. This is phenomenological (fluid models do not fix the exponent); it makes
    goodput depend on how many flows a link carries, worse at lower bandwidth.
    """

    exponent: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "exponent", check_real("Congestion.exponent", self.exponent, 0))

    def capacity(
        self,
        usage: np.ndarray,
        floor: np.ndarray | None,
        capacity: np.ndarray,
        congestible: np.ndarray | None = None,
    ) -> np.ndarray:
        """Effective per-link capacity.

        Args:
          usage: (K, L) flows of class k on one link of class l.
          floor: (K,) per-flow floor rate of each class, or None (no congestion).
          capacity: (L,) nominal capacity of one link of each class.
          congestible: (L,) bool, the classes that can congest (default all).
        """
        if floor is None or self.exponent == 0:
            return capacity
        need = floor @ usage
        over = need > capacity
        if congestible is not None:
            over &= congestible
        ratio = np.ones_like(capacity)
        ratio[over] = capacity[over] / need[over]
        return capacity * ratio**self.exponent


def max_min_rates(usage: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    """Max-min fair per-flow rates by progressive filling.

    All unfrozen classes raise their per-flow rate together until a link fills; the classes
    crossing a full link freeze; repeat until all are frozen.

    Args:
      usage: (K, L) flows of class k on one link of class l (0 where the class does not cross it).
      capacity: (L,) bytes/s of one link of each class.

    Returns:
      (K,) per-flow rate of each class, bytes/s.
    """
    usage = check_array("usage", usage, ndim=2, lo=0)
    capacity = check_array("capacity", capacity, ndim=1)
    if usage.shape[1] != capacity.shape[0] or (capacity <= 0).any():
        raise ValueError(
            f"capacity must be (L,) > 0 with L = usage.shape[1] = {usage.shape[1]}, got "
            f"{short(capacity)}"
        )
    rem = capacity.copy()
    rate = np.zeros(usage.shape[0])
    live = usage.sum(axis=1) > 0
    if not live.all():
        raise ValueError("every flow class passed to max_min_rates must cross a link")
    crosses = usage > 0
    while live.any():
        load = usage[live].sum(axis=0)
        used = load > 0
        inc = np.min(rem[used] / load[used])
        rate[live] += inc
        rem -= inc * load
        full = used & (rem <= _TOL * capacity)
        rem[full] = 0.0
        live &= ~crosses[:, full].any(axis=1)
    return rate


def _rates(
    usage: np.ndarray, net: Network, floor: np.ndarray | None, congestion: Congestion | None
) -> np.ndarray:
    cap = net.capacity
    if congestion is not None:
        cap = congestion.capacity(usage, floor, net.capacity, net.congestible)
    return max_min_rates(usage, cap)


def simulate(net: Network, flows: Flows, congestion: Congestion | None = None) -> np.ndarray:
    """Event-driven max-min simulation with per-path-class virtual clocks.

    Between events the rates are constant; an event is a batch of groups starting at the same
    time or the groups of one or more classes finishing. Within a class all flows share one rate,
    so the class's groups finish in the order of their tags `V(start) + size`.

    Args:
      net: the link classes.
      flows: the flow groups (their paths index `net`'s classes).
      congestion: optional goodput loss on overloaded links (needs `flows.floor`).

    Returns:
      (F,) completion time of each group, seconds.
    """
    _check_run(net, flows, congestion)
    if flows.paths.shape[1] != net.capacity.shape[0]:
        raise ValueError(
            f"flows cross {flows.paths.shape[1]} link classes, network has {net.capacity.shape[0]}"
        )
    per_flow = flows.paths / net.multiplicity  # share of one link a single flow represents
    order = np.lexsort((flows.path, flows.start))
    starts, paths, sizes = flows.start[order], flows.path[order], flows.size[order]
    counts = flows.count[order].astype(np.float64)
    num_groups, num_classes = order.shape[0], flows.paths.shape[0]
    n_active = np.zeros(num_classes)
    clock = np.zeros(num_classes)  # V[k]: bytes served to one flow of class k so far
    heaps: list[list[tuple[float, int]]] = [[] for _ in range(num_classes)]
    active: set[int] = set()
    finish = np.full(num_groups, np.nan)
    t, i = 0.0, 0
    while i < num_groups or active:
        rates = np.zeros(num_classes)
        on = n_active > 0
        if on.any():
            floor = None if flows.floor is None else flows.floor[on]
            rates[on] = _rates(per_flow[on] * n_active[on, None], net, floor, congestion)
        dt_fin = min(((heaps[k][0][0] - clock[k]) / rates[k] for k in active), default=np.inf)
        t_next = starts[i] if i < num_groups else np.inf
        if t_next <= t + dt_fin:  # starts first on ties: a zero-length step follows
            clock += rates * (t_next - t)
            t = t_next
            while i < num_groups and starts[i] == t_next:
                k = int(paths[i])
                heapq.heappush(heaps[k], (clock[k] + sizes[i], i))
                n_active[k] += counts[i]
                active.add(k)
                i += 1
            continue
        clock += rates * dt_fin
        t += dt_fin
        for k in list(active):
            heap = heaps[k]
            while heap and heap[0][0] - clock[k] <= _TOL * heap[0][0]:
                _, g = heapq.heappop(heap)
                finish[g] = t
                n_active[k] -= counts[g]
            if not heap:
                n_active[k] = 0.0  # drop float residue so the class counts as idle
                active.discard(k)
    out = np.empty(num_groups)
    out[order] = finish
    return out


def simulate_reference(
    net: Network, flows: Flows, congestion: Congestion | None = None
) -> np.ndarray:
    """The same model computed plainly: remaining bytes per group, water-filling over groups.

    Cost grows with groups x events; meant for small unaggregated clusters in tests.
    """
    _check_run(net, flows, congestion)
    per_flow = flows.paths[flows.path] / net.multiplicity
    usage = per_flow * flows.count[:, None]
    remaining = flows.size.astype(np.float64).copy()
    started = np.zeros(remaining.shape[0], dtype=bool)
    finish = np.full(remaining.shape[0], np.nan)
    t = 0.0
    while np.isnan(finish).any():
        started |= flows.start <= t
        live = started & np.isnan(finish)
        waiting = flows.start[~started]
        t_next = waiting.min() if waiting.size else np.inf
        if not live.any():
            t = t_next
            continue
        floor = None if flows.floor is None else flows.floor[flows.path[live]]
        rate = _rates(usage[live], net, floor, congestion)
        dt = min(np.min(remaining[live] / rate), t_next - t)
        remaining[live] -= rate * dt
        t += dt
        done = live.copy()
        done[live] = remaining[live] <= _TOL * flows.size[live]
        finish[done] = t
    return finish


def _check_run(net, flows, congestion) -> None:
    check_type("net", net, Network, "a sim.Network")
    check_type("flows", flows, Flows, "a sim.Flows")
    if congestion is not None:
        check_type("congestion", congestion, Congestion, "a sim.Congestion or None")
    if flows.paths.shape[1] != net.capacity.shape[0]:
        raise ValueError(
            f"flows cross {flows.paths.shape[1]} link classes, network has {net.capacity.shape[0]}"
        )


def phase_end(flows: Flows, finish: np.ndarray, tag: int | None = None) -> float:
    """When the last group (of traffic `tag`, or of all) finished; 0 for no traffic."""
    sel = finish if tag is None else finish[flows.tag == tag]
    return float(sel.max()) if sel.size else 0.0
