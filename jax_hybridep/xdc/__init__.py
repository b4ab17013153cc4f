"""Cross-datacenter expert parallelism (the HybridEP paper, DESIGN §4).

* `ExpertDomains`: the runtime — split a level into domains, all-gather experts inside a domain
  (optionally SR-compressed, `compress`), dispatch tokens only between domains.
* `volumes`, `cost`, `planner`: per-level bytes of that runtime, the paper's stream model and its
  extensions, and `plan(...)`, which picks the fastest per-level domain sizes.
"""

from jax_hybridep.xdc import compress
from jax_hybridep.xdc.domains import ExpertDomains

__all__ = ["ExpertDomains", "compress"]
