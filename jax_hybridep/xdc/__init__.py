"""Cross-datacenter expert parallelism (the HybridEP paper, DESIGN §4).

* `ExpertDomains` (`domains`): the runtime — split a level into domains, all-gather experts inside
  a domain (optionally SR-compressed, `compress`), dispatch tokens only between domains.
* `volumes`: the bytes that runtime moves per level (expected, or exact for a routing).
* `cost`: the paper's stream model and the extended multi-level model (latency, shared uplinks,
  backward reduce-scatter, skew, compression); `paper` (imported on its own, or run as
  `python -m jax_hybridep.xdc.paper`): the paper's tables reproduced.
* `planner.plan(cluster, workload)`: the fastest per-level domain sizes under that model.
"""

from jax_hybridep.xdc import compress, cost, domains, planner, volumes
from jax_hybridep.xdc.domains import ExpertDomains
from jax_hybridep.xdc.planner import Workload, plan

__all__ = [
    "ExpertDomains",
    "Workload",
    "compress",
    "cost",
    "domains",
    "plan",
    "planner",
    "volumes",
]
