"""Cross-datacenter expert parallelism (the HybridEP paper, docs/design.md §4), in two parts
that share three plain modules and never import each other's internals:

* shared: `migration` (`Migration`, the one value of cross-DC EP everywhere: the domains, and how
  experts travel: SR compression and its shared expert, gradient compression with error feedback;
  exact only when nothing is compressed), `expert_wire` (what an expert costs on the wire) and
  `geometry` (where replicas live).
* `runtime` (JAX): `ExpertDomains` (`domains`) splits a level into domains, all-gathers experts
  inside a domain, dispatches tokens only between domains; `migrate` holds the collectives (fused
  over matrices and layers), `compress` what travels.
* `model` (numpy): `volumes` (the bytes the runtime moves per level), `cost` (the paper's stream
  model and the extended multi-level model), `planner.plan(cluster, workload)` (the fastest
  per-level domain sizes under that model, within a memory limit, per layer if asked) and
  `replanning` (`replan` / `Replanner`: plan again as the measured routing and the links change).

The SR compression ratio (full bytes / bytes sent) is called `compression` throughout; the
training examples' flag is `--domain_compression`, beside `--domains`. The runtime's and the
model's modules stay reachable by their short names (`xdc.domains`, `xdc.volumes`, ...). The
model's names load at first use (`__getattr__`), so what a block runs (`jax_hybridep.nn`: the
shared modules and the runtime) imports no cost model, planner or re-planner.
"""

import sys

from jax_hybridep.xdc import expert_wire, geometry, migration
from jax_hybridep.xdc.migration import SHARED_VARIANTS, Migration
from jax_hybridep.xdc.runtime import compress, domains, migrate
from jax_hybridep.xdc.runtime.domains import ExpertDomains

# The cost model's public names, loaded by `__getattr__` at first use.
_MODEL_NAMES = (
    "LinkSchedule",
    "Replanner",
    "Workload",
    "cost",
    "loads",
    "model",
    "parse_links",
    "plan",
    "planner",
    "replan",
    "replanning",
    "volumes",
)


def __getattr__(name: str):
    if name not in _MODEL_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    # numpy only; what a block runs never comes here
    from jax_hybridep.xdc.model import cost, loads, planner, replanning, volumes  # noqa: PLC0415

    loaded = dict(
        LinkSchedule=replanning.LinkSchedule,
        Replanner=replanning.Replanner,
        Workload=planner.Workload,
        cost=cost,
        loads=loads,
        model=sys.modules[f"{__name__}.model"],  # bound by the import above
        parse_links=replanning.parse_links,
        plan=planner.plan,
        planner=planner,
        replan=replanning.replan,
        replanning=replanning,
        volumes=volumes,
    )
    globals().update(loaded)  # later look-ups find them without coming here
    return loaded[name]


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODEL_NAMES))


__all__ = [
    "expert_wire",
    "SHARED_VARIANTS",
    "ExpertDomains",
    "LinkSchedule",
    "Migration",
    "Replanner",
    "Workload",
    "compress",
    "cost",
    "domains",
    "geometry",
    "loads",
    "migrate",
    "migration",
    "parse_links",
    "plan",
    "planner",
    "replan",
    "replanning",
    "volumes",
]
