"""The JAX runtime of cross-DC expert parallelism (per shard, inside `jax.shard_map`):

* `domains`: `ExpertDomains`, a `Migration`'s domains resolved on a mesh: the split mesh, the
  replica placement and the token topology; the experts' gather inside a domain;
* `migrate`: the collectives (all-gather of experts, reduce-scatter of their gradients, the SR
  shared expert's refresh), fused over matrices and layers;
* `compress`: what travels (SR compression and gradient compression) and their top-k code.

It shares `xdc.migration`, `xdc.expert_wire` and `xdc.geometry` with the cost model
(`xdc.model`) and imports nothing else of it.
"""
