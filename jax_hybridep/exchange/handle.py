"""What one dispatch hands to its combine and to both VJPs (per shard), built by the walk
(`walk.dispatch`) beside it; users meet it as `jax_hybridep.Handle` (`Dispatched.handle`).

A `Handle` is private to the route (backend and steps) and plan (topology, config, shapes) of
the dispatch that made it: `combine` checks that statically. Its arrays are per shard and named:

* `row_pos [T, K]`: the destination row of each (t, k), -1 when invalid or dropped.
* `dest [T, K]`: the destination EP rank of each kept (t, k), -1 otherwise.
* `row_end []`: sum(group_sizes) of this rank's rows: rows at or past it are padding.
* `shard`: this shard's EP rank and EP-group id.
* `levels`: one record per walked level (slow -> fast), of that level step's kind.
* `bottom`: the bottom's record (where each row came from).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax

from jax_hybridep.config import DispatchPlan
from jax_hybridep.exchange.steps import Shard
from jax_hybridep.pytree import pytree_record, static_field

if TYPE_CHECKING:  # routes imports every step kind; the handle only names its type
    from jax_hybridep.exchange.routes import Route


@pytree_record
@dataclasses.dataclass(frozen=True)
class Handle:
    row_pos: jax.Array
    dest: jax.Array
    row_end: jax.Array
    shard: Shard
    levels: tuple[Any, ...]
    bottom: Any
    plan: DispatchPlan = static_field()
    route: Route = static_field()
