"""Re-planning during training: new domains when the measured routing or the links change.

* `replan(current, cluster, workload, routing)`: plans again (`planner.plan`) and keeps the
  current domains unless the new ones are predicted faster by more than `min_gain` (a change
  costs a recompile) or the current ones no longer fit the memory limit.
* `LinkSchedule`: link bandwidths given to the run by step (fake devices have no links to
  measure), e.g. "200:dc=1" (the DC link drops to 1 Gbps at step 200).
* `Replanner`: what a training loop calls every N steps with the routing it measured (the
  blocks' `tokens_per_expert`, one row per layer); it answers the per-layer domains to switch to,
  or None to keep the compiled step.
* `parse_links`: a cluster from "dc=10:5:shared,node=100,local=3600" (Gbps, optional latency in
  ms, "shared" for a site uplink: the ranks below the level share its bandwidth).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np

from jax_hybridep.values import check_array, check_int, check_real, check_str, check_type
from jax_hybridep.xdc.model import cost, planner

GBPS = 1e9 / 8  # bytes/s in one Gbit/s


def parse_links(spec: str, levels: Mapping[str, int]) -> cost.Cluster:
    """A `cost.Cluster` over `levels` ({name: size}, slow -> fast) from a spec
    "LEVEL=GBPS[:MS][:shared],...": every level named once (ValueError names an item that is
    not understood)."""
    check_str("links", spec)
    if not isinstance(levels, Mapping):
        raise TypeError(f"levels must be a {{name: size}} mapping, slow -> fast, got {levels!r}")
    links = {}
    for item in spec.split(","):
        name, _, rest = item.strip().partition("=")
        parts = rest.split(":")
        try:
            gbps = check_real(f"links {name}", float(parts[0]), positive=True)
            ms = check_real(f"links {name} latency", float(parts[1]), 0.0) if len(parts) > 1 else 0
        except ValueError:
            raise ValueError(
                f"links={spec!r}: {item!r} is not LEVEL=GBPS[:LATENCY_MS][:shared] with a "
                "bandwidth > 0 and a latency >= 0"
            ) from None
        shared = len(parts) > 2 and parts[2] == "shared"
        if name not in levels or name in links or len(parts) > 3 or (len(parts) > 2 and not shared):
            raise ValueError(
                f"links={spec!r}: {item!r} must name one of the levels {list(levels)} once, as "
                "LEVEL=GBPS[:LATENCY_MS][:shared]"
            )
        bw = gbps * GBPS
        links[name] = cost.Link(bandwidth=bw, alpha=ms * 1e-3, uplink=bw if shared else None)
    missing = [n for n in levels if n not in links]
    if missing:
        raise ValueError(f"links={spec!r} gives no link for the levels {missing}")
    return cost.Cluster(tuple(levels.values()), tuple(links[n] for n in levels), tuple(levels))


@dataclasses.dataclass(frozen=True)
class LinkSchedule:
    """Link bandwidths by step: `changes` = ((step, {level: Gbps}), ...), in step order; from a
    change's step on, the level's link runs at that bandwidth (its uplink scaled alike)."""

    changes: tuple[tuple[int, tuple[tuple[str, float], ...]], ...] = ()

    def __post_init__(self):
        changes, last = [], -1
        for change in self.changes:
            step, pairs = change
            step = check_int("LinkSchedule step", step, last + 1, what=f"an int >= {last + 1}")
            names = [name for name, _ in pairs]
            if (
                not pairs
                or len(set(names)) != len(names)
                or not all(isinstance(n, str) for n in names)
            ):
                raise ValueError(
                    f"link schedule step {step}: name each level once, got {list(names)}"
                )  # a level named twice would keep the last value without a word
            pairs = tuple(
                (n, check_real(f"link schedule {n} Gbps", g, positive=True)) for n, g in pairs
            )
            changes.append((step, pairs))
            last = step
        object.__setattr__(self, "changes", tuple(changes))

    @classmethod
    def parse(cls, spec: str | None, levels: Sequence[str]) -> LinkSchedule:
        """From "STEP:LEVEL=GBPS[,LEVEL=GBPS][;STEP:...]" (None or "": no change); steps strictly
        increasing, each level named once per step."""
        if isinstance(levels, str) or not all(isinstance(n, str) for n in levels):
            raise TypeError(f"levels must be a sequence of level names, got {levels!r}")
        if spec is not None:
            check_str("link_schedule", spec)
        if not spec:
            return cls()
        changes = []
        for entry in spec.split(";"):
            step, _, rest = entry.strip().partition(":")
            try:
                step = check_int("step", int(step), 0)
                pairs = []
                for item in rest.split(","):
                    name, _, gbps = item.strip().partition("=")
                    if name not in levels:
                        raise ValueError(name)
                    pairs.append((name, check_real("Gbps", float(gbps), positive=True)))
            except ValueError:
                raise ValueError(
                    f"link_schedule={spec!r}: {entry!r} is not STEP:LEVEL=GBPS[,LEVEL=GBPS] with "
                    f"LEVEL one of {list(levels)}, a step >= 0 and a bandwidth > 0"
                ) from None
            changes.append((step, tuple(pairs)))
        steps = [s for s, _ in changes]
        if steps != sorted(set(steps)):
            raise ValueError(f"link_schedule={spec!r}: steps must increase, got {steps}")
        try:
            return cls(tuple(changes))
        except ValueError as err:
            raise ValueError(f"link_schedule={spec!r}: {err}") from None

    def gbps_at(self, step: int) -> dict[str, float]:
        """{level: Gbps} of every change in force at `step` (latest wins)."""
        check_int("step", step, 0)
        now: dict[str, float] = {}
        for at, pairs in self.changes:
            if at <= step:
                now.update(pairs)
        return now

    def cluster_at(self, base: cost.Cluster, step: int) -> cost.Cluster:
        """`base` with the bandwidths in force at `step`."""
        check_type("base", base, cost.Cluster, "a cost.Cluster")
        now = self.gbps_at(step)
        names = base.names or ()
        links = []
        for i, link in enumerate(base.links):
            name = names[i] if i < len(names) else None
            if name not in now:
                links.append(link)
                continue
            bw = now[name] * GBPS
            uplink = None if link.uplink is None else link.uplink * bw / link.bandwidth
            links.append(dataclasses.replace(link, bandwidth=bw, uplink=uplink))
        return dataclasses.replace(base, links=tuple(links))


@dataclasses.dataclass(frozen=True)
class Replan:
    """`replan`'s answer.

    Attributes:
      layer_domains: the domains to run, one tuple per layer.
      changed: whether they differ from the current ones.
      plan: the fresh plan.
      current: the current domains evaluated under the same conditions.
    """

    layer_domains: tuple[tuple[int, ...], ...]
    changed: bool
    plan: planner.Plan
    current: planner.Candidate


def replan(
    current,
    cluster: cost.Cluster,
    workload: planner.Workload,
    routing="uniform",
    *,
    memory_limit_bytes: int | None = None,
    per_layer: bool = False,
    min_gain: float = 0.0,
) -> Replan:
    """Plans again for `cluster` and `routing` (as `planner.plan`) from the `current` domains (a
    tuple for all layers or one per layer): switches only when the new plan is predicted faster
    than the current domains by more than `min_gain` (a fraction), or they no longer fit."""
    min_gain = check_real("replan: min_gain", min_gain, 0.0, 1.0, below_hi=True)
    fresh = planner.plan(
        cluster, workload, routing, memory_limit_bytes=memory_limit_bytes, per_layer=per_layer
    )
    now = planner.evaluate(cluster, workload, current, routing, memory_limit_bytes)
    better = fresh.best.time < now.time * (1 - min_gain)
    if fresh.best.layer_domains != now.layer_domains and (better or not now.feasible):
        return Replan(fresh.best.layer_domains, True, fresh, now)
    return Replan(now.layer_domains, False, fresh, now)


def routing_from_counts(tokens_per_expert) -> list[np.ndarray]:
    """Per layer, expert probabilities [E] from measured rows per expert [layers, E] (a layer
    that routed nothing counts as uniform; NaN or a negative count is refused, not read as
    uniform)."""
    counts = check_array("tokens_per_expert", tokens_per_expert, ndim=2, lo=0)
    out = []
    for row in counts:
        total = row.sum()
        out.append(row / total if total > 0 else np.full(row.shape, 1 / row.size))
    return out


class Replanner:
    """Re-plans a training run every `every` steps from its measured routing and the link
    bandwidths the schedule gives for that step.

    Args:
      cluster: the links at step 0.
      workload: the model step (its `layers` MoE layers).
      every: steps between re-plans (>= 1).
      schedule: bandwidth changes by step (`LinkSchedule`).
      memory_limit_bytes, per_layer, min_gain: as `replan`.
      layer_domains: the domains the run starts with (default: planned for step 0 under
        uniform routing).

    `history` records every re-plan: step, Gbps in force, the measured routing's skew (busiest
    expert / mean, worst layer), the domains chosen, whether they changed, predicted step
    seconds of the current and the chosen domains.
    """

    def __init__(
        self,
        cluster: cost.Cluster,
        workload: planner.Workload,
        *,
        every: int,
        schedule: LinkSchedule | None = None,
        memory_limit_bytes: int | None = None,
        per_layer: bool = True,
        min_gain: float = 0.05,
        layer_domains=None,
    ):
        self.every = check_int("Replanner: every", every, 1)
        check_type("cluster", cluster, cost.Cluster, "a cost.Cluster")
        check_type("workload", workload, planner.Workload, "a planner.Workload")
        if schedule is not None:
            check_type("schedule", schedule, LinkSchedule, "a LinkSchedule (LinkSchedule.parse)")
        self.min_gain = check_real("Replanner: min_gain", min_gain, 0.0, 1.0, below_hi=True)
        self.cluster, self.workload = cluster, workload
        self.schedule = schedule or LinkSchedule()
        # How every plan is made, the first one and each re-plan.
        self.plan_options = dict(memory_limit_bytes=memory_limit_bytes, per_layer=per_layer)
        if layer_domains is None:
            first = self.schedule.cluster_at(cluster, 0)
            layer_domains = planner.plan(first, workload, **self.plan_options).layer_domains
        self.layer_domains = planner.layer_list(layer_domains, workload.layers)
        self.history: list[dict] = []

    def due(self, step: int) -> bool:
        """Whether to re-plan after `step` steps."""
        check_int("step", step, 0)
        return step > 0 and step % self.every == 0

    def update(self, step: int, tokens_per_expert) -> tuple[tuple[int, ...], ...] | None:
        """Re-plans from the rows per expert measured ([layers, E]); returns the per-layer
        domains to switch to, or None when the current ones stay (nothing to recompile)."""
        check_int("step", step, 0)
        probs = routing_from_counts(tokens_per_expert)
        if probs[0].size != self.workload.num_experts:
            raise ValueError(
                f"tokens_per_expert has {probs[0].size} experts per layer, the workload "
                f"{self.workload.num_experts}"
            )
        if len(probs) != self.workload.layers:
            raise ValueError(
                f"tokens_per_expert has {len(probs)} layers, the workload {self.workload.layers}"
            )
        cluster = self.schedule.cluster_at(self.cluster, step)
        current = tuple(self.layer_domains)
        r = replan(
            current, cluster, self.workload, probs, min_gain=self.min_gain, **self.plan_options
        )
        chosen = (
            r.plan.best
            if r.changed
            else planner.evaluate(cluster, self.workload, r.layer_domains, probs)
        )
        self.history.append(
            dict(
                step=step,
                gbps={
                    n: link.bandwidth / GBPS
                    for n, link in zip(cluster.names or (), cluster.links, strict=False)
                },
                skew=max(skew(p) for p in probs),
                layer_domains=[list(d) for d in r.layer_domains],
                changed=r.changed,
                current_s=r.current.time,
                chosen_s=chosen.time,
            )
        )
        if not r.changed:
            return None
        self.layer_domains = list(r.layer_domains)
        return tuple(r.layer_domains)


def skew(probs) -> float:
    """Busiest expert's share over the mean share (1 = uniform); probs [E] finite, >= 0."""
    p = check_array("probs", probs, ndim=1, lo=0)
    return float(p.max() * p.size / max(p.sum(), math.ulp(1.0)))
