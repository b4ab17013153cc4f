"""Backend selection: the routes as one table, and the `Route` one call runs.

`IMPLEMENTATIONS` lists every way a backend runs, in the order selection tries them (after
tokamax's implementations-as-data): each names itself and its backend once, says which
topologies it serves and builds the `Steps` of its `Route` (a layout step, one level step per
walked level, a bottom, the FP8 carrier), and the bottom says which plans it cannot serve
(`unsupported_reason`). `implementation_for` is the one scan of the table: selection takes the
first implementation of the requested backend that serves the topology, if the plan suits it:

| name          | backend | serves            | layout         | levels walked       | bottom     |
|---------------|---------|-------------------|----------------|---------------------|------------|
| `xla_ragged`  | `xla`   | GPU, TPU          | JnpLayout      | RaggedLevel x L     | XlaRows    |
| `xla`         | `xla`   | any other         | JnpLayout      | XlaLevel x L        | XlaRows    |
| `host_fused`  | `ffi`   | CPU, one local lvl| HostLayout     | none                | HostFused  |
| `host_walked` | `ffi`   | CPU, otherwise    | Host(Gathered) | HostDirect/Packed xL| HostRows   |
| `cuda`        | `ffi`   | GPU               | CudaLayout     | RaggedLevel x (L-1) | CudaBottom |

(Host layouts gather through the rendezvous when the EP group is in this process, through XLA
otherwise; a host level is direct-write when its ranks share the process, packed otherwise.)

`xla` runs everywhere; `ffi` where its handlers are built and every mesh axis is manual. `auto`
takes the first implementation, in table order, that serves the call and may be picked
automatically (`auto_pick`), else `xla`; a forced `ffi` that cannot run raises ValueError with
the reason. The env var JAX_HYBRIDEP_BACKEND overrides the config.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

from jax_hybridep.config import BACKEND_ENV, BACKENDS, DispatchConfig, DispatchPlan
from jax_hybridep.exchange import (
    cuda,
    host_fused,
    host_steps,
    layout_steps,
    ragged_steps,
    xla_steps,
)
from jax_hybridep.exchange.steps import Bottom, LayoutStep, LevelStep
from jax_hybridep.exchange.wire import Carrier, WireForm
from jax_hybridep.topology import Topology


@dataclasses.dataclass(frozen=True)
class Steps:
    """What an implementation builds on a topology it serves (its `Route` without the name).

    Attributes:
      layout: the layout step.
      levels: one level step per walked level, slow -> fast (all levels, or all but the fastest
        when the bottom spans it).
      bottom: where the items become expert-major rows.
      carrier: how its steps carry FP8 payload and scales (exchange/wire.py), None where FP8 on
        the wire is not built.
    """

    layout: LayoutStep
    levels: tuple[LevelStep, ...]
    bottom: Bottom
    carrier: Carrier | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Route(Steps):
    """The steps one dispatch (and its combine and VJPs) runs: static and hashable; made by
    `Implementation.route`.

    Attributes:
      name: the implementation it comes from (`IMPLEMENTATIONS`), which names it.
      backend: "xla" or "ffi", the backend that implementation implements.
    """

    name: str
    backend: str

    def check(self, topology: Topology) -> None:
        """Raises ValueError unless the route walks exactly the topology's levels."""
        spanned = 1 if self.bottom.spans_level else 0
        if len(self.levels) + spanned != len(topology.levels):
            raise ValueError(
                f"route walks {len(self.levels)} level(s) and its bottom spans {spanned}, but "
                f"the topology has {len(topology.levels)}: {topology.levels}"
            )

    def wire_form(self, plan: DispatchPlan) -> WireForm:
        """How `plan`'s tokens travel on this route (the one place that decides it)."""
        return WireForm.of(self.carrier, bool(self.levels), plan)


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One way a backend runs: which topologies it serves and the steps it builds there.

    Attributes:
      name: its name, the one its routes carry (Route.name).
      backend: the backend it implements.
      serves: whether it can run on a topology (platform, levels, processes).
      build: its steps on a topology it serves.
      auto_pick: whether `backend="auto"` may select it.
    """

    name: str
    backend: str
    serves: Callable[[Topology], bool]
    build: Callable[[Topology], Steps]
    auto_pick: bool = True

    def route(self, topology: Topology) -> Route:
        """Its route on `topology` (one it serves)."""
        steps = self.build(topology)
        return Route(**vars(steps), name=self.name, backend=self.backend)


def _xla(topology: Topology) -> Steps:
    levels = (xla_steps.XlaLevel(),) * len(topology.levels)
    return Steps(layout_steps.JnpLayout(), levels, xla_steps.XlaRows(), Carrier.SPLIT)


def _xla_ragged(topology: Topology) -> Steps:
    levels = (ragged_steps.RaggedLevel(),) * len(topology.levels)
    return Steps(layout_steps.JnpLayout(), levels, xla_steps.XlaRows(), Carrier.SPLIT)


def _host_layout(topology: Topology) -> LayoutStep:
    if topology.single_process:
        return layout_steps.HostLayout()
    return layout_steps.HostGatheredLayout()


def _host_fused_serves(topology: Topology) -> bool:
    return topology.platform == "cpu" and len(topology.levels) == 1 and topology.level_local[0]


def _host_fused(topology: Topology) -> Steps:
    return Steps(_host_layout(topology), (), host_fused.HostFused(), Carrier.WIRE_ROWS)


def _host_walked(topology: Topology) -> Steps:
    levels = tuple(
        host_steps.HostDirectLevel() if local else host_steps.HostPackedLevel()
        for local in topology.level_local
    )
    return Steps(_host_layout(topology), levels, host_steps.HostRows(), Carrier.WIRE_ROWS)


def _cuda(topology: Topology) -> Steps:
    slow = (ragged_steps.RaggedLevel(),) * (len(topology.levels) - 1)
    return Steps(layout_steps.CudaLayout(), slow, cuda.CudaBottom(), Carrier.SEND_QUANTISES)


IMPLEMENTATIONS: tuple[Implementation, ...] = (
    # Where XLA compiles ragged_all_to_all (GPU, TPU) the xla backend sends real items only; the
    # padded `xla` entry serves everything else (XLA:CPU cannot compile the op).
    Implementation("xla_ragged", "xla", ragged_steps.compiles_ragged, _xla_ragged),
    Implementation("xla", "xla", lambda t: True, _xla),
    Implementation("host_fused", "ffi", _host_fused_serves, _host_fused),
    Implementation("host_walked", "ffi", lambda t: t.platform == "cpu", _host_walked),
    # `auto` keeps to `xla` on GPUs until a lent GPU measures `ffi` faster (docs/benchmarks.md):
    # the transport that ran on an H200 (2026-11-29, since retired) was exact but 4x slower, and
    # today's has not run on a GPU yet. The one place that says so; backend="ffi" opts in.
    Implementation("cuda", "ffi", lambda t: t.platform == "gpu", _cuda, auto_pick=False),
)


def implementation_for(backend: str, topology: Topology) -> Implementation | None:
    """The first implementation of `backend` serving `topology`, in table order (the one scan)."""
    return next((i for i in IMPLEMENTATIONS if i.backend == backend and i.serves(topology)), None)


def unsupported_reason(topology: Topology, manual_axes) -> str | None:
    """Why the ffi backend cannot run on this topology, or None when it can (checked at trace
    time): the native module, its handlers for the platform, the manual axes."""
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


def requested_backend(config: DispatchConfig) -> str:
    """config.backend, or the env var JAX_HYBRIDEP_BACKEND when it is set."""
    requested = os.environ.get(BACKEND_ENV, config.backend)
    if requested not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={requested!r}; expected one of {BACKENDS}")
    return requested


def route_for(backend: str, topology: Topology) -> Route:
    """The route of `backend` ("xla" or "ffi") on `topology`: its first implementation serving
    the topology (no plan checked)."""
    impl = implementation_for(backend, topology)
    if impl is None:
        raise ValueError(f"no {backend!r} implementation serves platform {topology.platform!r}")
    return impl.route(topology)


def select(config: DispatchConfig, topology: Topology, manual_axes, plan: DispatchPlan) -> Route:
    """The route this call runs: the requested backend's first implementation serving the
    topology, when its bottom can serve the plan (and, for `auto`, it is picked automatically);
    otherwise `auto` falls back to `xla` and a forced `ffi` raises ValueError naming why."""
    requested = requested_backend(config)
    if requested == "xla":
        return route_for("xla", topology)
    reason = unsupported_reason(topology, manual_axes)
    if reason is None:
        impl = implementation_for("ffi", topology)
        if impl is None:
            reason = f"no 'ffi' implementation serves platform {topology.platform!r}"
        elif requested == "auto" and not impl.auto_pick:
            return route_for("xla", topology)
        else:
            route = impl.route(topology)
            reason = route.bottom.unsupported_reason(plan, route.wire_form(plan))
            if reason is None:
                return route
    if requested == "ffi":
        raise ValueError(
            f"backend='ffi' cannot run this dispatch: {reason}. Use backend='xla' or 'auto'."
        )
    return route_for("xla", topology)
