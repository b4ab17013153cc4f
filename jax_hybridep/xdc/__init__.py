"""Cross-datacenter expert parallelism (the HybridEP paper, docs/design.md §4).

* `ExpertDomains` (`domains`): the runtime — split a level into domains, all-gather experts inside
  a domain, dispatch tokens only between domains. `migrate` holds the collectives (fused over
  matrices and layers), `compress` what travels (`Migration`: SR compression and its shared
  expert, gradient compression with error feedback; exact only when nothing is compressed).
* `volumes`: the bytes that runtime moves per level (expected, or exact for a routing), from
  `geometry` (where replicas live), `loads` (token copies per rank) and `wire` (an expert's bytes,
  whole or compressed).
* `cost`: the paper's stream model and the extended multi-level model (latency, shared uplinks,
  backward reduce-scatter, skew, compression, dense gradients).
* `planner.plan(cluster, workload)`: the fastest per-level domain sizes under that model, within a
  memory limit, per layer if asked; `replan` / `Replanner` (`replanning`) plan again as the
  measured routing and the links change.
* `paper` and `reproduction` (imported on their own, or run as `python -m jax_hybridep.xdc.paper`):
  the paper's tables reproduced, with pass / fail tiers.

The SR compression ratio (full bytes / bytes sent) is called `compression` throughout; the Flax
block and the training examples name it `domain_compression`, beside `expert_domains`.
"""

from jax_hybridep.xdc import compress, cost, domains, migrate, planner, replanning, volumes
from jax_hybridep.xdc.compress import Migration
from jax_hybridep.xdc.domains import ExpertDomains
from jax_hybridep.xdc.planner import Workload, plan
from jax_hybridep.xdc.replanning import LinkSchedule, Replanner, parse_links, replan

__all__ = [
    "ExpertDomains",
    "LinkSchedule",
    "Migration",
    "Replanner",
    "Workload",
    "compress",
    "cost",
    "domains",
    "migrate",
    "parse_links",
    "plan",
    "planner",
    "replan",
    "replanning",
    "volumes",
]
