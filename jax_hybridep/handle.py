"""The values one dispatch hands to its combine and to both VJPs (per shard).

A `Handle` is private to one backend and plan (topology, config, shapes): `combine` checks that
statically. Its arrays are per shard; the common ones mean the same in every backend:

* `row_pos [T, K]`: the destination row of each (t, k), -1 when invalid or dropped.
* `dest [T, K]`: the destination EP rank of each kept (t, k), -1 otherwise.
* `rank`, `group`: this shard's EP rank and EP-group id (int32 scalars).
* `private`: backend-specific arrays (receive-side metadata, per-level send layouts).
"""

from __future__ import annotations

import dataclasses

import jax

from jax_hybridep.config import Plan


@dataclasses.dataclass(frozen=True)
class Layout:
    """Result of the layout step of one level (per shard)."""

    row_pos: jax.Array  # [T, K] int32
    group_sizes: jax.Array  # [L] int32
    tokens_per_expert: jax.Array  # [E] int32, global, before drops
    dropped: jax.Array  # [] int32, this shard's rows dropped over capacity
    invalid: jax.Array  # [] int32, this shard's invalid expert ids


@dataclasses.dataclass(frozen=True)
class Handle:
    row_pos: jax.Array
    dest: jax.Array
    rank: jax.Array
    group: jax.Array
    private: tuple
    plan: Plan

    @property
    def backend(self) -> str:
        return self.plan.backend


jax.tree_util.register_dataclass(
    Handle,
    data_fields=["row_pos", "dest", "rank", "group", "private"],
    meta_fields=["plan"],
)
jax.tree_util.register_dataclass(
    Layout,
    data_fields=["row_pos", "group_sizes", "tokens_per_expert", "dropped", "invalid"],
    meta_fields=[],
)
