"""The cost model and planner of cross-DC expert parallelism (numpy, no JAX):

* `volumes`: the bytes the runtime moves per level (expected, or exact for a routing), from
  `xdc.geometry` (where replicas live), `loads` (token copies per rank) and `xdc.expert_wire` (an
  expert's bytes, whole or compressed);
* `cost`: the paper's stream model and the extended multi-level model (latency, shared uplinks,
  backward reduce-scatter, skew, compression, dense gradients);
* `planner`: `plan(cluster, workload)`, the fastest per-level domain sizes, within a memory limit,
  per layer if asked;
* `replanning`: `replan` / `Replanner`, planning again as the measured routing and the links
  change.

It shares `xdc.migration`, `xdc.expert_wire` and `xdc.geometry` with the runtime (`xdc.runtime`) and
imports nothing else of it.
"""
