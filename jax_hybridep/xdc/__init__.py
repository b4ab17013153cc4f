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
model's modules stay reachable by their short names (`xdc.domains`, `xdc.volumes`, ...).
"""

from jax_hybridep.xdc import expert_wire, geometry, migration
from jax_hybridep.xdc.migration import SHARED_VARIANTS, Migration
from jax_hybridep.xdc.model import cost, loads, planner, replanning, volumes
from jax_hybridep.xdc.model.planner import Workload, plan
from jax_hybridep.xdc.model.replanning import LinkSchedule, Replanner, parse_links, replan
from jax_hybridep.xdc.runtime import compress, domains, migrate
from jax_hybridep.xdc.runtime.domains import ExpertDomains

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
