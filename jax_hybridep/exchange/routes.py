"""Backend selection: (backend, topology, platform) -> the `Route` one call runs.

| backend, platform             | layout             | levels walked            | bottom      |
|-------------------------------|--------------------|--------------------------|-------------|
| `xla`, any                    | JnpLayout          | XlaLevel x L             | XlaRows     |
| `ffi`, CPU, 1 in-process level| Host(Gathered)     | none                     | HostFused   |
| `ffi`, CPU, otherwise         | Host(Gathered)     | HostDirect/HostPacked x L| HostRows    |
| `ffi`, GPU                    | CudaLayout         | XlaLevel x (L - 1)       | CudaBottom  |

(Host layouts gather through the rendezvous when the EP group is in this process, through XLA
otherwise; a host level is direct-write when its ranks share the process, packed otherwise.)

`xla` runs everywhere; `ffi` where its handlers are built and every mesh axis is manual. `auto`
picks `ffi` when it can run the call and `xla` otherwise, except on GPUs (`GPU_AUTO` below); the
env var JAX_HYBRIDEP_BACKEND overrides the config.
"""

from __future__ import annotations

import dataclasses
import os

from jax_hybridep.config import BACKEND_ENV, BACKENDS, DispatchConfig
from jax_hybridep.exchange import cuda, host_fused, host_steps, layout_steps, xla_steps
from jax_hybridep.exchange.steps import Bottom, LayoutStep, LevelStep
from jax_hybridep.topology import Topology

# Whether `auto` picks the CUDA handlers on GPUs: the one place that says so. Off until a lent GPU
# measures `ffi` faster than `xla` (docs/benchmarks.md): the transport that ran on an H200
# (2026-11-29, since retired) was exact but 4x slower, and today's has not run on a GPU yet.
# backend="ffi" opts in.
GPU_AUTO = False


@dataclasses.dataclass(frozen=True)
class Route:
    """The steps one dispatch (and its combine and VJPs) runs: static and hashable.

    Attributes:
      backend: "xla" or "ffi", the resolved backend this route implements.
      layout: the layout step.
      levels: one level step per walked level, slow -> fast (all levels, or all but the fastest
        when the bottom spans it).
      bottom: where the items become expert-major rows.
      fp8_wire: how FP8 payload and scales travel on this route ("split", "bytes" or "fused":
        exchange/wire.py), None where FP8 on the wire is not built.
    """

    backend: str
    layout: LayoutStep
    levels: tuple[LevelStep, ...]
    bottom: Bottom
    fp8_wire: str | None = None

    def check(self, topology: Topology) -> None:
        """Raises ValueError unless the route walks exactly the topology's levels."""
        spanned = 1 if self.bottom.spans_level else 0
        if len(self.levels) + spanned != len(topology.levels):
            raise ValueError(
                f"route walks {len(self.levels)} level(s) and its bottom spans {spanned}, but "
                f"the topology has {len(topology.levels)}: {topology.levels}"
            )


def unsupported_reason(topology: Topology, manual_axes) -> str | None:
    """Why the ffi backend cannot run this call, or None when it can (checked at trace time)."""
    from jax_hybridep import _native  # noqa: PLC0415  (import registers the targets)

    if not _native.available():
        return f"the native module is not built ({_native.IMPORT_ERROR})"
    platforms = _native.platforms()
    if topology.platform not in platforms:
        return (
            f"this build has no '{topology.platform}' handlers for the ffi backend "
            f"(available: {platforms})"
        )
    unmanaged = [a for a in topology.group_axes if a not in manual_axes]
    if unmanaged:
        return (
            f"mesh axes {unmanaged} outside the EP group are not manual in the enclosing "
            "shard_map, so devices of different EP groups cannot be told apart; make every mesh "
            "axis manual (shard_map over all axes)"
        )
    return None


def backend_name(config: DispatchConfig, topology: Topology, manual_axes) -> str:
    """The backend this call runs on; raises ValueError when `ffi` is forced but cannot run."""
    requested = os.environ.get(BACKEND_ENV, config.backend)
    if requested not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={requested!r}; expected one of {BACKENDS}")
    if requested == "xla":
        return "xla"
    if requested == "auto" and topology.platform == "gpu" and not GPU_AUTO:
        return "xla"
    reason = unsupported_reason(topology, manual_axes)
    if reason is None:
        return "ffi"
    if requested == "ffi":
        raise ValueError(
            f"backend='ffi' cannot run this dispatch: {reason}. Use backend='xla' or 'auto'."
        )
    return "xla"


def route_for(backend: str, topology: Topology) -> Route:
    """The route of `backend` ("xla" or "ffi") on `topology`."""
    num_levels = len(topology.levels)
    if backend == "xla":
        return Route("xla", layout_steps.JnpLayout(), (xla_steps.XlaLevel(),) * num_levels,
                     xla_steps.XlaRows(), fp8_wire="split")  # fmt: skip
    if topology.platform == "gpu":
        slow = (xla_steps.XlaLevel(),) * (num_levels - 1)
        return Route("ffi", layout_steps.CudaLayout(), slow, cuda.CudaBottom(), fp8_wire="fused")
    layout = (
        layout_steps.HostLayout() if topology.single_process else layout_steps.HostGatheredLayout()
    )
    if num_levels == 1 and topology.level_local[0]:
        return Route("ffi", layout, (), host_fused.HostFused(), fp8_wire="bytes")
    levels = tuple(
        host_steps.HostDirectLevel() if local else host_steps.HostPackedLevel()
        for local in topology.level_local
    )
    return Route("ffi", layout, levels, host_steps.HostRows(), fp8_wire="bytes")


def route(config: DispatchConfig, topology: Topology, manual_axes) -> Route:
    """The route this call runs (backend selection included)."""
    return route_for(backend_name(config, topology, manual_axes), topology)
