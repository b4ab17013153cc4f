"""The planner: the fastest per-level domain sizes for a cluster and a workload.

`plan(cluster, workload)` evaluates every realisable domain tuple (one divisor per level) with the
extended cost model (`cost.step_cost`) on this runtime's volumes (`volumes`, so the bytes it
reports are the ones the runtime moves), charging what the workload configures (SR compression
and its reference variant, gradient compression, prefetch, the dense gradients), and returns the
fastest. Plain EP (every S_l = 1) is always a candidate, so under the model the plan is never
slower than plain EP; ties go to the fewest replicas.

Memory (`memory_limit_bytes`): a candidate is feasible when a rank's `Workload.memory_bytes` fits:
the resident bytes given plus the expert replicas it holds (every layer's when training or
prefetching), the gradient compression's residuals and the persistent shared experts.

Per-layer plans (`per_layer=True`, layers routed differently or a memory limit that fits
replicas for only some layers): each layer picks its own domains, the sum of the layers' costs
minimised under the memory limit (exact over the candidates, by dynamic programming over
(memory, time) frontiers), then compared with the best uniform plan by the full step model.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence

import numpy as np

from jax_hybridep.values import (
    check_array,
    check_bool,
    check_int,
    check_ints,
    check_type,
    is_real,
)
from jax_hybridep.xdc import expert_wire
from jax_hybridep.xdc.migration import Migration
from jax_hybridep.xdc.model import cost, volumes

# The Workload fields `volumes.expected_volumes` / `routed_volumes` take as they are.
_VOLUME_FIELDS = (
    "num_experts",
    "hidden",
    "act_bytes",
    "expert_bytes",
    "expert_matrices",
    "migration",
    "value_bytes",
    "dense_bytes",
)


@dataclasses.dataclass(frozen=True)
class Workload:
    """One MoE model step, per rank and per layer where not said otherwise.

    Attributes:
      tokens: T, tokens per rank.
      top_k: K, distinct experts per token.
      num_experts: E (a multiple of the number of ranks).
      hidden: H.
      act_bytes: bytes per activation element.
      expert_bytes: P1, one expert's parameter bytes (or give `expert_matrices`).
      expert_matrices: element count (or shape) of each of an expert's matrices.
      value_bytes: bytes per parameter value.
      migration: how experts travel, as the runtime is configured (`xdc.Migration`: SR
        compression of the forward gather, its reference variant and refresh period, gradient
        compression). Its `domains` must be empty: they are what the planner chooses.
      prefetch: every layer's experts gathered at step start (one collective per level).
      layers: MoE layers per step.
      training: forward + backward (True) or forward only.
      compute: fixed compute seconds per step.
      lat_pe: pre-expert compute seconds per layer the forward gather may hide under.
      expert_probs: [E] routing probabilities for skewed expected routing (None: uniform).
      dense_bytes: bytes of the replicated (data-parallel) parameters whose gradients each
        training step all-reduces over every rank; the same for every domain choice (0: left out).
      resident_bytes: a rank's memory besides what domains add (parameters, optimizer state,
        activations), for `memory_bytes`.
    """

    tokens: int
    top_k: int
    num_experts: int
    hidden: int
    act_bytes: int
    expert_bytes: int | None = None
    expert_matrices: tuple | None = None
    value_bytes: int = 4
    migration: Migration = Migration()
    prefetch: bool = False
    layers: int = 1
    training: bool = True
    compute: float = 0.0
    lat_pe: float = 0.0
    expert_probs: tuple[float, ...] | None = None
    dense_bytes: int = 0
    resident_bytes: int = 0

    def __post_init__(self):
        counts = dict(
            tokens=(self.tokens, 0),
            top_k=(self.top_k, 1),
            num_experts=(self.num_experts, 1),
            hidden=(self.hidden, 1),
            act_bytes=(self.act_bytes, 1),
            value_bytes=(self.value_bytes, 1),
            layers=(self.layers, 1),
            dense_bytes=(self.dense_bytes, 0),
            resident_bytes=(self.resident_bytes, 0),
        )
        if self.expert_bytes is not None:
            counts["expert_bytes"] = (self.expert_bytes, 0)
        for name, (value, low) in counts.items():
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < low:
                raise ValueError(f"Workload.{name} must be an integer >= {low}, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"Workload.top_k={self.top_k} exceeds num_experts={self.num_experts}")
        for name in ("compute", "lat_pe"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or not 0 <= value < math.inf:
                raise ValueError(f"Workload.{name} must be seconds >= 0, got {value!r}")
        check_bool("Workload.prefetch", self.prefetch)
        check_bool("Workload.training", self.training)
        if not isinstance(self.migration, Migration):
            raise TypeError(
                f"Workload.migration must be a jax_hybridep.xdc.Migration, got {self.migration!r}"
            )
        if self.migration.domains:
            raise ValueError(
                f"Workload.migration names domains {self.migration.domains}: the planner chooses "
                "them (start a Replanner from given ones with layer_domains=...)"
            )
        if self.expert_probs is not None:
            probs = check_array("Workload.expert_probs", self.expert_probs, ndim=1, lo=0)
            if probs.size != self.num_experts or not probs.sum() > 0:
                raise ValueError(
                    f"Workload.expert_probs must be [{self.num_experts}] probabilities >= 0, not "
                    f"all 0, got {len(probs)} values summing to {probs.sum():g}"
                )
            object.__setattr__(self, "expert_probs", tuple(float(p) for p in probs))
        self.expert_bytes_full()  # exactly one of expert_bytes, expert_matrices; sizes >= 0

    def volumes(self, level_sizes: Sequence[int], domains: Sequence[int], routing="uniform"):
        """This runtime's volumes of one layer: expected ("uniform"; `expert_probs` if set), for
        [E] expert probabilities, or exact for a [G, T, K] `topk_idx`."""
        common = {name: getattr(self, name) for name in _VOLUME_FIELDS}
        probs = self.expert_probs
        if isinstance(routing, str):
            if routing != "uniform":
                raise ValueError(
                    f"routing must be 'uniform', [E] expert probabilities or a [G, T, K] "
                    f"topk_idx array, got {routing!r}"
                )
        elif np.ndim(routing) == 1:
            probs = tuple(float(p) for p in check_array("routing", routing, ndim=1, lo=0))
            if len(probs) != self.num_experts:
                raise ValueError(
                    f"routing has {len(probs)} expert probabilities, the workload "
                    f"{self.num_experts} experts"
                )
        else:
            return volumes.routed_volumes(level_sizes, domains, np.asarray(routing), **common)
        return volumes.expected_volumes(
            level_sizes,
            domains,
            tokens=self.tokens,
            top_k=self.top_k,
            expert_probs=probs,
            **common,
        )

    def cost(self, cluster: cost.Cluster, vols) -> cost.StepCost:
        """The step's cost for one `Volumes` (every layer alike) or one per layer."""
        layers = self.layers if isinstance(vols, volumes.Volumes) else None
        return cost.step_cost(
            cluster,
            vols,
            layers=layers,
            training=self.training,
            compute=self.compute,
            lat_pe=self.lat_pe,
            prefetch=self.prefetch,
        )

    def expert_bytes_full(self) -> int:
        """P1: one expert's parameter bytes."""
        return expert_wire.expert_bytes_on_wire(
            self.expert_bytes, self.expert_matrices, None, self.value_bytes
        )[0]

    def layer_memory_bytes(self, level_sizes: Sequence[int], domains: Sequence[int]) -> int:
        """Bytes a rank holds for one layer's domains beyond its own experts: the `S - 1` other
        replicas per own expert, the error-feedback residuals (gradient compression: per inner
        level, the gradient entering its reduce-scatter) and a persistent shared expert."""
        p1 = self.expert_bytes_full()
        local = self.num_experts // math.prod(level_sizes)
        s = math.prod(domains)
        if s == 1:
            return 0
        mig = self.migration
        out = (s - 1) * local * p1
        if mig.grad_compression is not None:
            held = 1
            for size in domains:
                if size > 1:
                    held *= size
                    out += held * local * p1
        if mig.persistent:
            out += p1
        return out

    def memory_bytes(self, level_sizes: Sequence[int], layer_domains) -> int:
        """A rank's memory: `resident_bytes` plus `layer_memory_bytes` of every layer (one
        domain tuple for all, or one per layer). Training keeps every layer's replicas for the
        backward and prefetch holds them all from step start; a forward pass without prefetch
        holds one layer's replicas at a time."""
        per_layer = layer_list(layer_domains, self.layers)
        extra = [self.layer_memory_bytes(level_sizes, d) for d in per_layer]
        if self.training or self.prefetch:
            return self.resident_bytes + sum(extra)
        p1 = self.expert_bytes_full()
        local = self.num_experts // math.prod(level_sizes)
        replicas = [(math.prod(d) - 1) * local * p1 for d in per_layer]
        rest = sum(e - r for e, r in zip(extra, replicas, strict=True))
        return self.resident_bytes + max(replicas) + rest


def layer_list(layer_domains, layers: int) -> list[tuple[int, ...]]:
    """One domain tuple per layer from a tuple for all layers or a sequence of them (ints only:
    a fractional size is refused, never truncated)."""
    check_int("layers", layers, 1)
    if isinstance(layer_domains, str) or not isinstance(layer_domains, Sequence):
        raise TypeError(
            f"layer_domains must be a domain tuple or one per layer, got {layer_domains!r}"
        )
    layer_domains = tuple(layer_domains)
    if layer_domains and all(is_real(s) for s in layer_domains):
        return [check_ints("domains", layer_domains, 1)] * layers
    if len(layer_domains) != layers:
        raise ValueError(f"got {len(layer_domains)} per-layer domain tuples for {layers} layers")
    return [check_ints(f"layer_domains[{i}]", d, 1) for i, d in enumerate(layer_domains)]


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One configuration and its predicted cost (seconds and bytes per step).

    Attributes:
      domains: the domain tuple of every layer (None when layers differ: `layer_domains`).
      cost: the step's `cost.StepCost`.
      volumes: the first layer's volumes (every layer's: `layer_volumes`).
      layer_domains: one domain tuple per layer.
      layer_volumes: one `Volumes` per layer.
      memory_bytes: a rank's memory under `Workload.memory_bytes`.
      feasible: whether it fits the plan's memory limit.
    """

    domains: tuple[int, ...] | None
    cost: cost.StepCost
    volumes: volumes.Volumes
    layer_domains: tuple[tuple[int, ...], ...] = ()
    layer_volumes: tuple[volumes.Volumes, ...] = ()
    memory_bytes: int = 0
    feasible: bool = True

    @property
    def comm_time(self) -> float:
        return self.cost.comm

    @property
    def time(self) -> float:
        return self.cost.time

    @property
    def bytes_per_level(self) -> tuple[float, ...]:
        """Bytes per rank per step at each level, all traffic (from `volumes`)."""
        return self.cost.bytes_per_level


@dataclasses.dataclass(frozen=True)
class Plan:
    """The planner's answer.

    Attributes:
      best: the fastest feasible candidate (its `layer_domains` may differ per layer).
      plain_ep: the all-ones candidate (plain EP), for comparison.
      candidates: every realisable domain tuple for all layers alike, in
        `volumes.realisable_domains` order (infeasible ones marked).
      names: level names, if the cluster has them.
      memory_limit_bytes: the limit the plan respects (None: none).
    """

    best: Candidate
    plain_ep: Candidate
    candidates: tuple[Candidate, ...]
    names: tuple[str, ...] | None = None
    memory_limit_bytes: int | None = None

    @property
    def domains(self) -> tuple[int, ...] | None:
        """The domain tuple of every layer (None when the layers' differ)."""
        return self.best.domains

    @property
    def layer_domains(self) -> tuple[tuple[int, ...], ...]:
        """One domain tuple per layer."""
        return self.best.layer_domains

    @property
    def comm_time(self) -> float:
        """Predicted exposed communication seconds per step."""
        return self.best.comm_time

    @property
    def time(self) -> float:
        """Predicted seconds per step (compute included)."""
        return self.best.time

    @property
    def bytes_per_level(self) -> tuple[float, ...]:
        return self.best.bytes_per_level

    @property
    def speedup(self) -> float:
        """Plain EP step time over the plan's (>= 1 under the model)."""
        return self.plain_ep.time / self.best.time

    def table(self) -> str:
        """Markdown table of every uniform candidate, fastest first (and a per-layer best)."""
        names = self.names or tuple(f"L{i}" for i in range(len(self.plain_ep.domains)))
        head = "| domains (" + ", ".join(names) + ") | comm s | step s | MB per level | MB mem |"
        rows = [head, "|---|---|---|---|---|"]
        shown = sorted(self.candidates, key=_rank)
        if self.best.domains is None:
            shown.insert(0, self.best)
        for c in shown:
            mb = ", ".join(f"{b / 1e6:.3g}" for b in c.bytes_per_level)
            label = c.domains if c.domains is not None else "per layer " + str(c.layer_domains)
            label = f"{label}" + ("" if c.feasible else " (over memory)")
            rows.append(
                f"| {label} | {c.comm_time:.4g} | {c.time:.4g} | {mb} | "
                f"{c.memory_bytes / 1e6:.3g} |"
            )
        return "\n".join(rows)


def _rank(c: Candidate):
    replicas = sum(math.prod(d) for d in c.layer_domains)
    return (not c.feasible, c.cost.time, replicas, c.layer_domains)


def _routings(routing, layers: int) -> list:
    """One routing entry per layer (a list of numbers is one [E] probability vector)."""
    if isinstance(routing, list | tuple) and routing and all(is_real(p) for p in routing):
        routing = np.asarray(routing, np.float64)
    if isinstance(routing, str) or (not isinstance(routing, list | tuple)):
        return [routing] * layers
    if len(routing) != layers:
        raise ValueError(f"routing gives {len(routing)} layers, the workload has {layers}")
    return list(routing)


def evaluate(
    cluster: cost.Cluster,
    workload: Workload,
    layer_domains,
    routing="uniform",
    memory_limit_bytes: int | None = None,
) -> Candidate:
    """The `Candidate` of one configuration: a domain tuple for all layers or one per layer."""
    check_type("cluster", cluster, cost.Cluster, "a cost.Cluster")
    check_type("workload", workload, Workload, "a planner.Workload")
    if memory_limit_bytes is not None:
        check_int("memory_limit_bytes", memory_limit_bytes, 0)
    sizes = tuple(cluster.level_sizes)
    per_layer = layer_list(layer_domains, workload.layers)
    routings = _routings(routing, workload.layers)
    seen: dict = {}  # layers alike (same domains, same routing object) share one evaluation
    for d, r in zip(per_layer, routings, strict=True):
        if (d, id(r)) not in seen:
            seen[(d, id(r))] = workload.volumes(sizes, d, r)
    vols = tuple(seen[(d, id(r))] for d, r in zip(per_layer, routings, strict=True))
    memory = workload.memory_bytes(sizes, per_layer)
    uniform = per_layer[0] if all(d == per_layer[0] for d in per_layer) else None
    return Candidate(
        domains=uniform,
        cost=workload.cost(cluster, list(vols)),
        volumes=vols[0],
        layer_domains=tuple(per_layer),
        layer_volumes=vols,
        memory_bytes=memory,
        feasible=memory_limit_bytes is None or memory <= memory_limit_bytes,
    )


def plan(
    cluster: cost.Cluster,
    workload: Workload,
    routing="uniform",
    *,
    candidates: Sequence[Sequence[int]] | None = None,
    memory_limit_bytes: int | None = None,
    per_layer: bool = False,
) -> Plan:
    """Picks the fastest per-level domain sizes under the extended model.

    Args:
      cluster: level sizes (slow -> fast) and links.
      workload: the model step.
      routing: "uniform" (expected volumes; skewed when `workload.expert_probs` is set), [E]
        expert probabilities, an actual [G, T, K] `topk_idx` routing of all ranks (exact
        volumes), or a list with one of those per layer.
      candidates: domain tuples to consider (default: all realisable); plain EP is always added.
      memory_limit_bytes: a rank's memory limit (`Workload.memory_bytes`); candidates over it
        are infeasible. ValueError when even plain EP exceeds it.
      per_layer: let each layer pick its own domains (see the module doc).

    Returns:
      A `Plan`: the best configuration, its predicted time, per-level bytes and memory, and all
      uniform candidates.
    """
    if not isinstance(cluster, cost.Cluster):
        raise ValueError(f"plan: cluster must be a cost.Cluster, got {type(cluster).__name__}")
    if not isinstance(workload, Workload):
        raise ValueError(
            f"plan: workload must be a planner.Workload, got {type(workload).__name__}"
        )
    if memory_limit_bytes is not None:
        memory_limit_bytes = check_int("plan: memory_limit_bytes", memory_limit_bytes, 0)
    check_bool("plan: per_layer", per_layer)
    sizes = tuple(cluster.level_sizes)
    plain = (1,) * len(sizes)
    todo = volumes.realisable_domains(sizes) if candidates is None else list(candidates)
    todo = [check_ints("plan: candidates[i]", d, 1) for d in todo]  # 1.5 is refused, not cut
    bad = [
        d
        for d in todo
        if len(d) != len(sizes) or any(s < 1 or g % s for g, s in zip(sizes, d, strict=False))
    ]
    if bad:
        raise ValueError(
            f"plan: candidates {bad} are not domain tuples of the levels {sizes} (one divisor "
            f"per level)"
        )
    if plain not in todo:
        todo.insert(0, plain)
    routings = _routings(routing, workload.layers)
    evaluated = tuple(evaluate(cluster, workload, d, routings, memory_limit_bytes) for d in todo)
    plain_ep = next(c for c in evaluated if c.domains == plain)
    if not plain_ep.feasible:
        raise ValueError(
            f"plan: even plain EP needs {plain_ep.memory_bytes:,} bytes per rank "
            f"(resident_bytes={workload.resident_bytes:,}), over "
            f"memory_limit_bytes={memory_limit_bytes:,}"
        )
    best = min(evaluated, key=_rank)
    if per_layer and workload.layers > 1:
        mixed = _per_layer_best(cluster, workload, todo, routings, memory_limit_bytes)
        if mixed is not None and mixed.feasible and _rank(mixed) < _rank(best):
            best = mixed
    return Plan(best, plain_ep, evaluated, cluster.names, memory_limit_bytes)


def _per_layer_best(cluster, workload, todo, routings, limit) -> Candidate | None:
    """The per-layer assignment minimising the sum of the layers' own costs within the memory
    limit (exact over `todo` by (memory, time) frontiers), evaluated by the full step model."""
    sizes = tuple(cluster.level_sizes)
    one = dataclasses.replace(workload, layers=1, dense_bytes=0, compute=0.0, prefetch=False)
    base = workload.memory_bytes(sizes, [(1,) * len(sizes)] * workload.layers)
    frontier = {0: (0.0, ())}  # extra memory -> (time, domains so far)
    for r in routings:
        options = []
        for d in todo:
            t = one.cost(cluster, one.volumes(sizes, d, r)).time
            options.append((one.layer_memory_bytes(sizes, d), t, d))
        step = {}
        for mem, (time, chosen) in frontier.items():
            for m, t, d in options:
                total = mem + m
                if limit is not None and base + total > limit:
                    continue
                if total not in step or time + t < step[total][0]:
                    step[total] = (time + t, (*chosen, d))
        # Keep the (memory, time) Pareto front: more memory must buy less time.
        frontier, best_time = {}, math.inf
        for mem in sorted(step):
            if step[mem][0] < best_time:
                frontier[mem], best_time = step[mem], step[mem][0]
        if not frontier:
            return None
    _, layer_domains = min(frontier.values(), key=lambda v: v[0])
    return evaluate(cluster, workload, layer_domains, routings, limit)
