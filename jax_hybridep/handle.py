"""What one dispatch hands to its combine and to both VJPs (per shard).

A `Handle` is private to the route (backend and steps) and plan (topology, config, shapes) of
the dispatch that made it: `combine` checks that statically. Its arrays are per shard and named:

* `row_pos [T, K]`: the destination row of each (t, k), -1 when invalid or dropped.
* `dest [T, K]`: the destination EP rank of each kept (t, k), -1 otherwise.
* `shard`: this shard's EP rank and EP-group id.
* `row_end []`: sum(group_sizes) of this rank's rows: rows at or past it are padding.
* `levels`: one record per walked level (slow -> fast), of that level step's kind.
* `bottom`: the bottom's record (where each row came from).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax

from jax_hybridep.config import DispatchPlan

if TYPE_CHECKING:
    from jax_hybridep.exchange.routes import Route
    from jax_hybridep.exchange.steps import Shard


@dataclasses.dataclass(frozen=True)
class Handle:
    row_pos: jax.Array
    dest: jax.Array
    row_end: jax.Array
    shard: Shard
    levels: tuple[Any, ...]
    bottom: Any
    plan: DispatchPlan
    route: Route


jax.tree_util.register_dataclass(
    Handle,
    data_fields=["row_pos", "dest", "row_end", "shard", "levels", "bottom"],
    meta_fields=["plan", "route"],
)
