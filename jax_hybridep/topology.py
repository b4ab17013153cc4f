"""Expert-parallel topology: which mesh axes form the EP group, level by level.

A `Topology` is static and hashable. Levels run slow -> fast (e.g. ("node", "local")); each level
is one or more mesh axes. The EP rank is row-major over the levels' axes, so it equals
`jax.lax.axis_index(topology.ep_axes)` inside `jax.shard_map`. Mesh axes outside the topology
(e.g. "data") index independent EP groups. One built by `from_mesh` holds that mesh (`mesh`), so
what runs over it (the Flax block) needs only the topology; the mesh is not part of its identity
(equality, hash).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import numpy as np

from jax_hybridep.values import check_bool, check_str, is_int, short


@dataclasses.dataclass(frozen=True)
class Topology:
    """The EP axes of a mesh, grouped into levels (slow -> fast).

    Attributes:
      levels: per level, the mesh axis names it spans.
      mesh_axes: all axis names of the mesh, in mesh order.
      mesh_shape: all axis sizes of the mesh, in mesh order.
      single_process: whether every device of the mesh belongs to this process.
      platform: the devices' platform ("cpu", "gpu", ...).
      level_local: per level, whether each rank's peers at that level (the ranks differing only in
        that level's coordinate) live in its own process, so they can exchange by direct write.
        Default: every level local when `single_process`, none otherwise.
      mesh: the mesh it was built from (`from_mesh`), or None. Not compared or hashed: two
        topologies of one shape and process layout are the same plan for dispatch and combine.
    """

    levels: tuple[tuple[str, ...], ...]
    mesh_axes: tuple[str, ...]
    mesh_shape: tuple[int, ...]
    single_process: bool = True
    platform: str = "cpu"
    level_local: tuple[bool, ...] | None = None  # always set after __post_init__
    mesh: jax.sharding.Mesh | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self):
        # Normalise sequences to tuples (hashable, comparable); a bare string is one axis name.
        object.__setattr__(self, "levels", _levels(self.levels))
        if isinstance(self.mesh_axes, str) or not isinstance(self.mesh_axes, Sequence):
            raise TypeError(
                f"Topology mesh_axes must be a sequence of axis names, got {short(self.mesh_axes)}"
            )
        if isinstance(self.mesh_shape, np.ndarray) and self.mesh_shape.ndim == 1:
            object.__setattr__(self, "mesh_shape", self.mesh_shape.tolist())
        if isinstance(self.mesh_shape, str) or not isinstance(self.mesh_shape, Sequence):
            raise TypeError(
                f"Topology mesh_shape must be a sequence of axis sizes, got "
                f"{short(self.mesh_shape)}"
            )
        object.__setattr__(self, "mesh_axes", tuple(self.mesh_axes))
        object.__setattr__(self, "mesh_shape", tuple(self.mesh_shape))
        if not all(isinstance(a, str) for a in self.mesh_axes):
            raise TypeError(f"Topology mesh_axes must be axis names (str), got {self.mesh_axes}")
        if len(set(self.mesh_axes)) != len(self.mesh_axes):
            raise ValueError(f"Topology mesh_axes name an axis twice: {self.mesh_axes}")
        if len(self.mesh_shape) != len(self.mesh_axes) or not all(
            is_int(n) and n >= 1 for n in self.mesh_shape
        ):
            raise ValueError(
                f"Topology mesh_shape {self.mesh_shape} must give one size >= 1 per mesh axis "
                f"{self.mesh_axes}"
            )
        object.__setattr__(self, "mesh_shape", tuple(int(n) for n in self.mesh_shape))
        object.__setattr__(
            self, "single_process", check_bool("single_process", self.single_process)
        )
        check_str("platform", self.platform)
        if not self.levels or any(not level for level in self.levels):
            raise ValueError(f"Topology needs at least one level of mesh axes, got {self.levels}")
        seen = [axis for level in self.levels for axis in level]
        if len(set(seen)) != len(seen):
            raise ValueError(f"Topology levels name a mesh axis twice: {self.levels}")
        missing = [axis for axis in seen if axis not in self.mesh_axes]
        if missing:
            raise ValueError(
                f"Topology levels {self.levels} name axes {missing} that are not in the mesh "
                f"(axes {self.mesh_axes})"
            )
        if self.level_local is None:
            object.__setattr__(self, "level_local", (self.single_process,) * len(self.levels))
        elif (
            not isinstance(self.level_local, Sequence)
            or len(self.level_local) != len(self.levels)
            or not all(isinstance(b, bool | np.bool_) for b in self.level_local)
        ):
            raise ValueError(
                f"level_local must be one bool per level ({len(self.levels)} levels "
                f"{self.levels}), got {short(self.level_local)}"
            )
        object.__setattr__(self, "level_local", tuple(bool(b) for b in self.level_local))
        if self.mesh is not None:
            if not isinstance(self.mesh, jax.sharding.Mesh):
                raise TypeError(
                    f"Topology mesh must be a jax.sharding.Mesh or None, got "
                    f"{type(self.mesh).__name__} {short(self.mesh)}"
                )
            if (tuple(self.mesh.axis_names), self.mesh.devices.shape) != (
                self.mesh_axes,
                self.mesh_shape,
            ):
                raise ValueError(
                    f"Topology mesh {dict(self.mesh.shape)} is not the mesh of its axes "
                    f"{self.mesh_dict}"
                )

    def __getstate__(self):
        """Pickled without its mesh: devices do not pickle, and the mesh is not part of a
        topology's identity (the unpickled one is equal, with mesh None)."""
        return {**self.__dict__, "mesh": None}

    def __deepcopy__(self, memo) -> Topology:
        return self  # immutable: a copy may be itself, keeping the very mesh

    @classmethod
    def from_mesh(
        cls, mesh: jax.sharding.Mesh, levels: Sequence[str | Sequence[str]] = ("ep",)
    ) -> Topology:
        """Builds the topology of `mesh` with `levels` given slow -> fast.

        Args:
          mesh: the device mesh the model runs on.
          levels: each entry a mesh axis name or a sequence of names forming one level, e.g.
            ("node", "local"), ("dc", "node", "local") or (("x", "y"),) for one level over two axes.
        """
        if not isinstance(mesh, jax.sharding.Mesh):
            raise TypeError(
                f"Topology.from_mesh: mesh must be a jax.sharding.Mesh, got "
                f"{type(mesh).__name__} {short(mesh)}"
            )
        norm = _levels(levels)
        names = tuple(mesh.axis_names)
        processes = np.vectorize(lambda d: d.process_index)(mesh.devices)
        level_local = []
        for level in norm:
            if any(axis not in names for axis in level):
                break  # __post_init__ reports the unknown axes
            # Move the level's axes last: each row is then one group of level peers.
            axes = [names.index(a) for a in level]
            rest = [i for i in range(len(names)) if i not in axes]
            groups = processes.transpose(rest + axes).reshape(
                -1, math.prod(processes.shape[i] for i in axes)
            )
            level_local.append(bool(np.all(groups == groups[:, :1])))
        return cls(
            levels=norm,
            mesh_axes=names,
            mesh_shape=tuple(mesh.devices.shape),
            single_process=bool(np.all(processes == jax.process_index())),
            platform=mesh.devices.flat[0].platform,
            level_local=tuple(level_local) if len(level_local) == len(norm) else None,
            mesh=mesh,
        )

    @property
    def ep_axes(self) -> tuple[str, ...]:
        """All EP mesh axes, slow -> fast: `axis_index(ep_axes)` is the EP rank."""
        return tuple(axis for level in self.levels for axis in level)

    @property
    def group_axes(self) -> tuple[str, ...]:
        """The mesh axes outside the EP group; their indices number the EP groups."""
        return tuple(axis for axis in self.mesh_axes if axis not in self.ep_axes)

    @property
    def mesh_dict(self) -> dict[str, int]:
        """Axis name -> size, for messages."""
        return dict(zip(self.mesh_axes, self.mesh_shape, strict=True))

    def axis_size(self, axis: str) -> int:
        if axis not in self.mesh_axes:
            raise ValueError(f"axis {axis!r} is not a mesh axis of this topology {self.mesh_axes}")
        return self.mesh_shape[self.mesh_axes.index(axis)]

    @property
    def ep_size(self) -> int:
        return math.prod(self.axis_size(axis) for axis in self.ep_axes)

    @property
    def level_sizes(self) -> tuple[int, ...]:
        """Ranks per level group: the product of the level's axis sizes."""
        return tuple(math.prod(self.axis_size(a) for a in level) for level in self.levels)

    @property
    def level_strides(self) -> tuple[int, ...]:
        """EP-rank stride of each level: rank = sum of coordinate * stride (row-major)."""
        sizes = self.level_sizes
        return tuple(math.prod(sizes[i + 1 :]) for i in range(len(sizes)))


def _levels(levels) -> tuple[tuple[str, ...], ...]:
    """Levels as tuples of axis names; a bare string is one level of one axis."""
    if isinstance(levels, str):
        return ((levels,),)
    try:
        norm = tuple((lvl,) if isinstance(lvl, str) else tuple(lvl) for lvl in levels)
    except TypeError:
        raise ValueError(
            f"Topology levels must be a sequence of axis names (or of sequences of them), got "
            f"{short(levels)}"
        ) from None
    if not all(isinstance(a, str) for level in norm for a in level):
        raise ValueError(f"Topology levels must name mesh axes by string, got {short(levels)}")
    return norm
