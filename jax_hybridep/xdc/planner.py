"""The planner: the fastest per-level domain sizes for a cluster and a workload.

`plan(cluster, workload)` evaluates every realisable domain tuple (one divisor per level) with the
extended cost model (`cost.step_cost`) on this runtime's volumes (`volumes`, so the bytes it
reports are the ones the runtime moves) and returns the fastest. Plain EP (every S_l = 1) is
always a candidate, so under the model the plan is never slower than plain EP; ties go to the
fewest replicas.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence

import numpy as np

from jax_hybridep.xdc import cost, volumes, wire


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
      compression: SR compression of the forward gather, full bytes / bytes sent (None or <= 1:
        off; the public `MoEBlock` keyword is `domain_compression`).
      layers: MoE layers per step.
      training: forward + backward (True) or forward only.
      compute: fixed compute seconds per step.
      lat_pe: pre-expert compute seconds per layer the forward gather may hide under.
      expert_probs: [E] routing probabilities for skewed expected routing (None: uniform).
      dense_bytes: bytes of the replicated (data-parallel) parameters whose gradients each
        training step all-reduces over every rank; the same for every domain choice (0: left out).
    """

    tokens: int
    top_k: int
    num_experts: int
    hidden: int
    act_bytes: int
    expert_bytes: int | None = None
    expert_matrices: tuple | None = None
    value_bytes: int = 4
    compression: float | None = None
    layers: int = 1
    training: bool = True
    compute: float = 0.0
    lat_pe: float = 0.0
    expert_probs: tuple[float, ...] | None = None
    dense_bytes: int = 0

    def __post_init__(self):
        counts = dict(
            tokens=(self.tokens, 0), top_k=(self.top_k, 1), num_experts=(self.num_experts, 1),
            hidden=(self.hidden, 1), act_bytes=(self.act_bytes, 1),
            value_bytes=(self.value_bytes, 1), layers=(self.layers, 1),
            dense_bytes=(self.dense_bytes, 0),
        )  # fmt: skip
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
        wire.compressed(self.compression)  # raises for a value that is not a positive number

    def volumes(self, level_sizes: Sequence[int], domains: Sequence[int], routing="uniform"):
        """This runtime's volumes: expected ("uniform") or exact for a [G, T, K] `topk_idx`."""
        common = dict(
            num_experts=self.num_experts,
            hidden=self.hidden,
            act_bytes=self.act_bytes,
            expert_bytes=self.expert_bytes,
            expert_matrices=self.expert_matrices,
            compression=self.compression,
            value_bytes=self.value_bytes,
            dense_bytes=self.dense_bytes,
        )
        if isinstance(routing, str):
            if routing != "uniform":
                raise ValueError(f"routing must be 'uniform' or a topk_idx array, got {routing!r}")
            return volumes.expected_volumes(
                level_sizes,
                domains,
                tokens=self.tokens,
                top_k=self.top_k,
                expert_probs=self.expert_probs,
                **common,
            )
        return volumes.routed_volumes(level_sizes, domains, np.asarray(routing), **common)

    def cost(self, cluster: cost.Cluster, vols: volumes.Volumes) -> cost.StepCost:
        return cost.step_cost(
            cluster,
            vols,
            layers=self.layers,
            training=self.training,
            compute=self.compute,
            lat_pe=self.lat_pe,
        )


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One domain tuple and its predicted cost (seconds and bytes per step)."""

    domains: tuple[int, ...]
    cost: cost.StepCost
    volumes: volumes.Volumes

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
      best: the fastest candidate.
      plain_ep: the all-ones candidate (plain EP), for comparison.
      candidates: every realisable domain tuple, in `volumes.realisable_domains` order.
      names: level names, if the cluster has them.
    """

    best: Candidate
    plain_ep: Candidate
    candidates: tuple[Candidate, ...]
    names: tuple[str, ...] | None = None

    @property
    def domains(self) -> tuple[int, ...]:
        return self.best.domains

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
        """Markdown table of every candidate, fastest first."""
        names = self.names or tuple(f"L{i}" for i in range(len(self.domains)))
        head = "| domains (" + ", ".join(names) + ") | comm s | step s | MB per level |"
        rows = [head, "|---|---|---|---|"]
        for c in sorted(self.candidates, key=_rank):
            mb = ", ".join(f"{b / 1e6:.3g}" for b in c.bytes_per_level)
            rows.append(f"| {c.domains} | {c.comm_time:.4g} | {c.time:.4g} | {mb} |")
        return "\n".join(rows)


def _rank(c: Candidate):
    return (c.cost.time, math.prod(c.domains), c.domains)


def plan(
    cluster: cost.Cluster,
    workload: Workload,
    routing="uniform",
    *,
    candidates: Sequence[Sequence[int]] | None = None,
) -> Plan:
    """Picks the fastest per-level domain sizes under the extended model.

    Args:
      cluster: level sizes (slow -> fast) and links.
      workload: the model step.
      routing: "uniform" (expected volumes; skewed when `workload.expert_probs` is set) or an
        actual [G, T, K] `topk_idx` routing of all ranks (exact volumes).
      candidates: domain tuples to consider (default: all realisable); plain EP is always added.

    Returns:
      A `Plan`: the best domains, their predicted time and per-level bytes, and all candidates.
    """
    if not isinstance(cluster, cost.Cluster):
        raise ValueError(f"plan: cluster must be a cost.Cluster, got {type(cluster).__name__}")
    if not isinstance(workload, Workload):
        raise ValueError(
            f"plan: workload must be a planner.Workload, got {type(workload).__name__}"
        )
    sizes = tuple(cluster.level_sizes)
    plain = (1,) * len(sizes)
    todo = volumes.realisable_domains(sizes) if candidates is None else list(candidates)
    todo = [tuple(int(s) for s in d) for d in todo]
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
    evaluated = []
    for domains in todo:
        vols = workload.volumes(sizes, domains, routing)
        evaluated.append(Candidate(domains, workload.cost(cluster, vols), vols))
    best = min(evaluated, key=_rank)
    plain_ep = next(c for c in evaluated if c.domains == plain)
    return Plan(best, plain_ep, tuple(evaluated), cluster.names)
