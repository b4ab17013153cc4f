"""Expert domains (HybridEP, docs/design.md §4): move experts inside a domain, tokens between
domains.

A domain of size S at a level splits that level's mesh axis into (outer, inner=S): S consecutive
members form a domain. Inside `jax.shard_map`, each rank all-gathers its domain peers' experts
over the inner axes (slow level first: across datacenters only the rank's own experts travel),
so it holds `S * E_local` expert slots (S = product over levels). Tokens then go only to ranks
with the same inner coordinates: the token EP group spans the outer axes, and each expert id is
placed on the replica inside the sender's own domain (`DispatchConfig.expert_placement`).

S = 1 everywhere is plain EP; S = a level's size means no token crosses that level.

Gradients are exact: the all-gather's transpose is a reduce-scatter that returns every replica's
gradient to the owner. `migration` (`xdc.Migration`) can compress what travels: SR
compression of the forward gather and gradient compression of the reduce-scatter, neither exact
(`jax_hybridep.xdc.compress`); the collectives themselves are in `xdc.migrate`.

Sharding model: `ExpertDomains.mesh` has the same devices in the same order as the model's mesh,
with each split axis `a` replaced by `a` (outer) and `a + "_domain"` (inner), so an array sharded
over the original EP axes has the same shards over `expert_axes`; `gather_experts` runs per shard.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax

from jax_hybridep.config import DispatchConfig
from jax_hybridep.topology import Topology
from jax_hybridep.values import check_int, check_type
from jax_hybridep.xdc import expert_wire, geometry
from jax_hybridep.xdc.migration import Migration
from jax_hybridep.xdc.runtime import migrate

INNER_SUFFIX = "_domain"


@dataclasses.dataclass(frozen=True)
class ExpertDomains:
    """Per-level domain sizes over a topology, and the split mesh they run on.

    Attributes:
      topology: the plain-EP topology (levels slow -> fast) of the model's mesh.
      sizes: per level, the domain size S_l (a divisor of the level's size; 1 = not split).
      migration: the `xdc.Migration` these domains were built from (its named sizes, and what
        travels: full experts and exact gradients by default; SR compression of the gather, its
        shared-expert variant, gradient compression).
      mesh: the model's mesh with each split axis replaced by (outer, inner).
    """

    topology: Topology
    sizes: tuple[int, ...]
    migration: Migration
    mesh: jax.sharding.Mesh

    @classmethod
    def from_mesh(
        cls, mesh: jax.sharding.Mesh, topology: Topology, migration: Migration
    ) -> ExpertDomains:
        """`migration`'s domains (one size per named level, 1 for the others) on `mesh`, the
        mesh `topology` was built from."""
        if not isinstance(migration, Migration):
            raise TypeError(
                f"migration must be a jax_hybridep.xdc.Migration (domain sizes and how experts "
                f"travel), got {migration!r}"
            )
        check_type("mesh", mesh, jax.sharding.Mesh, "a jax.sharding.Mesh")
        check_type("topology", topology, Topology, "a jax_hybridep.Topology")
        if (tuple(mesh.axis_names), tuple(mesh.devices.shape)) != (
            topology.mesh_axes,
            topology.mesh_shape,
        ):
            raise ValueError(
                f"the topology was built for mesh {topology.mesh_dict}, not this mesh "
                f"{dict(zip(mesh.axis_names, mesh.devices.shape, strict=True))}"
            )
        names = [level[0] for level in topology.levels]
        given = dict(migration.domains)
        unknown = sorted(set(given) - set(names))
        if unknown:
            raise ValueError(
                f"domain sizes name {unknown}, which are not levels of the topology "
                f"{topology.levels}"
            )
        sizes = tuple(given.get(name, 1) for name in names)
        for level, size, level_size in zip(
            topology.levels, sizes, topology.level_sizes, strict=True
        ):
            if size < 1 or level_size % size:
                raise ValueError(
                    f"domain size {size} at level {level} must divide the level size {level_size}"
                )
            if size > 1 and len(level) > 1:
                raise ValueError(
                    f"level {level} spans several mesh axes; only a single-axis level can be "
                    f"split into domains"
                )
        return cls(topology, sizes, migration, _split_mesh(mesh, topology, sizes))

    @property
    def compression(self) -> float | None:
        """The SR compression ratio of the gather (None: full experts)."""
        return self.migration.compression

    # -- geometry -----------------------------------------------------------------------------

    @property
    def domain_size(self) -> int:
        """S: expert replicas per rank = S * E_local."""
        return math.prod(self.sizes)

    @property
    def outer_sizes(self) -> tuple[int, ...]:
        """Per level, the number of domains n_l = G_l / S_l."""
        return tuple(g // s for g, s in zip(self.topology.level_sizes, self.sizes, strict=True))

    @property
    def inner_axes(self) -> tuple[str, ...]:
        """The inner (domain) axes, slow -> fast: the experts' all-gather runs over them."""
        return tuple(
            level[0] + INNER_SUFFIX
            for level, size in zip(self.topology.levels, self.sizes, strict=True)
            if size > 1
        )

    @property
    def expert_axes(self) -> tuple[str, ...]:
        """Mesh axes of the expert dim on `mesh`: the same shards as the topology's EP axes."""
        axes = []
        for level, size in zip(self.topology.levels, self.sizes, strict=True):
            axes += level
            if size > 1:
                axes.append(level[0] + INNER_SUFFIX)
        return tuple(axes)

    @property
    def token_levels(self) -> tuple[tuple[str, ...], ...]:
        """Levels of the token exchange: the outer axes that still have several domains."""
        levels = tuple(
            level
            for level, outer in zip(self.topology.levels, self.outer_sizes, strict=True)
            if outer > 1
        )
        # Every level replicated: the token group is one rank; keep the fastest (size 1) axis.
        return levels or (self.topology.levels[-1],)

    @functools.cached_property
    def token_topology(self) -> Topology:
        """The topology `dispatch`/`combine` run on: outer axes only (inner axes are groups)."""
        return Topology.from_mesh(self.mesh, levels=self.token_levels)

    def local_experts(self, num_experts: int) -> int:
        """E_local: experts each rank owns."""
        check_int("num_experts", num_experts, 1)
        ep = self.topology.ep_size
        if num_experts % ep:
            raise ValueError(
                f"num_experts={num_experts} is not divisible by the EP size {ep} "
                f"(levels {self.topology.levels})"
            )
        return num_experts // ep

    def placement(self, num_experts: int) -> tuple[tuple[int, int], ...]:
        """Per expert, (token-group rank, slot) of the replica in the sender's own domain.

        See `geometry.replica_placement`; the slot order is that of `gather_experts`.
        """
        self.local_experts(num_experts)  # validates divisibility
        ranks, slots = geometry.replica_placement(
            self.topology.level_sizes, self.sizes, num_experts
        )
        return tuple((int(r), int(s)) for r, s in zip(ranks, slots, strict=True))

    def dispatch_config(self, config: DispatchConfig) -> DispatchConfig:
        """`config` with the replica placement and S * E_local slots per rank."""
        check_type("config", config, DispatchConfig, "a jax_hybridep.DispatchConfig")
        e = config.num_experts
        return dataclasses.replace(
            config,
            expert_placement=self.placement(e),
            num_local_slots=self.domain_size * self.local_experts(e),
        )

    # -- per shard ----------------------------------------------------------------------------

    @property
    def inner_sizes(self) -> tuple[int, ...]:
        """The sizes of `inner_axes`."""
        return tuple(s for s in self.sizes if s > 1)

    def gather_experts(
        self,
        weights: Sequence[jax.Array],
        reference: Sequence[jax.Array] = (),
        feedback: Sequence[Sequence[jax.Array]] = (),
    ) -> tuple[jax.Array, ...]:
        """Inside `jax.shard_map` over `mesh`: [E_local, ...] each -> [S * E_local, ...] each.

        Slot order matches `placement`. The matrices (of one layer or many) travel in one
        collective per inner axis (`xdc.migrate.gather`). Without compression this is a plain
        all-gather: its autodiff transpose reduce-scatters the replicas' gradients to the owner.

        Args:
          reference: per matrix, the persistent shared expert (SR, shared="persistent").
          feedback: per inner axis per matrix, the error-feedback residuals (gradient
            compression; shapes `feedback_shapes`).
        """
        if isinstance(weights, str) or not isinstance(weights, Sequence):  # not one array
            raise TypeError(
                f"weights must be a sequence of arrays (one per matrix), got {weights!r}"
            )
        weights = tuple(weights)
        if not self.inner_axes:
            return weights
        return migrate.gather(weights, self.inner_axes, self.migration, reference, feedback)

    def feedback_shapes(self, shapes: Sequence[tuple[int, ...]]):
        """Per inner axis per matrix (per-shard shape [E_local, ...]), the per-shard shape of
        the gradient compression's error-feedback residual (`xdc.migrate.feedback_shapes`)."""
        return migrate.feedback_shapes(shapes, self.inner_sizes)

    def gather_bytes(self, weights: Sequence[jax.Array]) -> dict[str, int]:
        """Bytes one rank receives per inner axis in the forward all-gather of `weights`
        (shapes per shard, [E_local, ...]), as sent: compressed when compression is on."""
        if not isinstance(weights, Sequence) or not weights:
            raise TypeError(f"weights must be a non-empty sequence of arrays, got {weights!r}")
        per_expert = sum(
            expert_wire.sent_bytes(w.shape[1:], w.dtype, self.compression) for w in weights
        )
        e_local, held, out = weights[0].shape[0], 1, {}
        for axis, size in zip(self.inner_axes, self.inner_sizes, strict=True):
            out[axis] = (size - 1) * held * e_local * per_expert
            held *= size
        return out


def _split_mesh(mesh, topology: Topology, sizes) -> jax.sharding.Mesh:
    """`mesh` with each split level axis `a` replaced by (`a`, `a + INNER_SUFFIX`)."""
    split = {level[0]: s for level, s in zip(topology.levels, sizes, strict=True) if s > 1}
    names, shape = [], []
    for name, size in zip(mesh.axis_names, mesh.devices.shape, strict=True):
        if name in split:
            names += [name, name + INNER_SUFFIX]
            shape += [size // split[name], split[name]]
        else:
            names.append(name)
            shape.append(size)
    clash = [n for n in names if names.count(n) > 1]
    if clash:
        raise ValueError(f"the split mesh would name axes {sorted(set(clash))} twice: {names}")
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    axis_types = tuple(types.get(n, types.get(n.removesuffix(INNER_SUFFIX))) for n in names)
    return jax.sharding.Mesh(mesh.devices.reshape(shape), tuple(names), axis_types=axis_types)
