"""Benchmark runner: builds every case on the given devices, times it, and collects the results.

A case is one (method, backend, topology, capacity, direction) program, `jax.jit(shard_map(...))`
compiled once and run on each routing's inputs (same shapes, so one compile per case). Timing is
dispatch + combine together (identity experts), forward or forward + backward (grad of
`sum(out * ct)` w.r.t. x and topk_weights), the median of `repeats` device-synchronised calls after
`warmup` calls. The floor of each routing is timed in the same process.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_hybridep as hep
from jax_hybridep.bench import baselines
from jax_hybridep.bench.workloads import BenchInputs, Preset

DIRECTIONS = ("fwd", "fwd+bwd")
TOPOLOGIES = ("flat", "hierarchical")
# hybridep's rows either go straight into combine, where XLA may fuse the xla backend's
# expansion away ("fusible"), or pass an optimization_barrier first, so every backend
# materialises them as a real expert layer would ("barrier").
VARIANTS = ("fusible", "barrier")


def keep_freed_memory() -> bool:
    """Tells glibc malloc to keep freed memory in the process (mmap threshold 1 GiB, trim
    threshold 2 GiB, top pad 64 MiB, one arena) instead of returning it to the OS; returns
    whether it could.

    XLA:CPU allocates every call's output and temporary buffers anew; by default glibc serves
    buffers over 32 MiB (and, after a trim, smaller ones) with fresh pages from the OS, which the
    kernel faults in and zeroes on first touch on every call. On 2 cores that costs more than
    the copies being measured. The device threads would each get an arena of their own, whose
    heaps are at most 64 MiB, so larger buffers (a dropless [C, H] at the CPU preset) were still
    fresh mmaps: one arena keeps them too. Call it before the first `jax.devices()`. The setting
    is process-wide, so it applies to every method and the floor alike
    (`--no-keep-freed-memory` turns it off). The library never changes it.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    m_trim_threshold, m_top_pad, m_mmap_threshold, m_arena_max = -1, -2, -3, -8
    settings = (
        (m_mmap_threshold, 1 << 30),
        (m_trim_threshold, 1 << 31),
        (m_top_pad, 64 << 20),
        (m_arena_max, 1),
    )
    return all(mallopt(option, value) == 1 for option, value in settings)


@dataclasses.dataclass(frozen=True)
class Budget:
    """A capacity setting: dropless with the opt-in row budget
    `DispatchConfig(row_budget=ceil(factor * T * K))` (T * K = the rows a rank receives on
    average); compared with the dropless baselines, its overflow counted in `dropped`."""

    factor: float

    def rows(self, tokens: int, top_k: int) -> int:
        return math.ceil(self.factor * tokens * top_k)


@dataclasses.dataclass(frozen=True)
class Case:
    method: str  # "hybridep" or a baseline name
    backend: str | None  # hybridep: HYBRIDEP_BACKENDS; maxtext: "ragged" | "padded"; else None
    topology: str  # "flat" | "hierarchical"
    capacity_factor: float | None  # None = dropless
    budget: Budget | None = None  # hybridep only: dropless with a row budget
    variant: str = "fusible"  # hybridep only: VARIANTS
    zero_padding: bool = True  # hybridep only: DispatchConfig.zero_padding
    wire_dtype: str | None = None  # hybridep only: DispatchConfig.wire_dtype

    @property
    def capacity(self) -> str:
        if self.budget is not None:
            return f"budget={self.budget.factor:g}"
        return "dropless" if self.capacity_factor is None else f"f={self.capacity_factor:g}"

    @property
    def baseline_capacity(self) -> str:
        """The capacity setting of the baselines this case is compared with."""
        return "dropless" if self.budget is not None else self.capacity

    @property
    def label(self) -> str:
        name = self.method if self.backend is None else f"{self.method}-{self.backend}"
        if self.method != "hybridep":
            return name
        suffix = (
            ("" if self.variant == "fusible" else f"+{self.variant}")
            + ("" if self.zero_padding else "+nozero")
            + ("" if self.wire_dtype is None else "+fp8")
        )
        return f"{name}/{self.topology}{suffix}"


def build_cases(
    capacities,
    methods,
    backends,
    topologies,
    ragged: bool,
    variants=("fusible",),
    zero_padding=True,
    wire_dtypes=(None,),
) -> list[Case]:
    """hybridep at every capacity (each variant); baselines at their own: GShard at each factor
    f, MaxText and worst-case buffers dropless. A `Budget` capacity runs hybridep only (against
    the dropless baselines)."""
    cases = []

    def hybridep(f, budget=None):
        return [
            Case("hybridep", b, t, f, budget, v, zero_padding, w)
            for w in wire_dtypes
            for v in variants
            for t in topologies
            for b in backends
        ]

    for f in capacities:
        if isinstance(f, Budget):
            if "hybridep" in methods:
                cases += hybridep(None, f)
            continue
        if "hybridep" in methods:
            cases += hybridep(f)
        if f is not None and "gshard" in methods:
            cases.append(Case("gshard", None, "flat", f))
        if f is None and "maxtext" in methods:
            cases.append(Case("maxtext", "ragged" if ragged else "padded", "flat", None))
        if f is None and "worst_case" in methods:
            cases.append(Case("worst_case", None, "flat", None))
    return cases


def make_meshes(devices, nodes: int):
    n = len(devices)
    auto = AxisType.Auto
    meshes = {"flat": (jax.make_mesh((n,), ("ep",), (auto,), devices=devices), ("ep",))}
    if nodes > 1 and n % nodes == 0 and n // nodes > 1:
        names = ("node", "local")
        mesh = jax.make_mesh((nodes, n // nodes), names, (auto, auto), devices=devices)
        meshes["hierarchical"] = (mesh, names)
    return meshes


# hybridep's backends (DispatchConfig.backend).
HYBRIDEP_BACKENDS = ("ffi", "xla")


def _shard_fn(case: Case, mesh, axes, experts: int):
    """Per-shard (x, idx, w) -> (out, dropped [], level_rows [levels], rows [] receive buffer)."""
    ranks = mesh.devices.size
    if case.method == "hybridep":
        topo = hep.Topology.from_mesh(mesh, levels=axes)
        traced = {}  # the route the dispatch took, set while tracing (level_traffic counts by it)

        def fn(x, idx, w):
            budget = None if case.budget is None else case.budget.rows(*idx.shape)
            cfg = hep.DispatchConfig(
                num_experts=experts,
                capacity_factor=case.capacity_factor,
                backend=case.backend,
                row_budget=budget,
                zero_padding=case.zero_padding,
                wire_dtype=case.wire_dtype,
            )
            d = hep.dispatch(x, idx, w, topology=topo, config=cfg)
            traced["route"] = d.handle.route
            rows = d.tokens
            if case.variant == "barrier":
                rows = jax.lax.optimization_barrier(rows)
            out = hep.combine(rows, d.handle, weights=d.weights)
            return out, d.stats.dropped, d.stats.level_rows, d.tokens

        fn.traced = traced
        return fn
    base = baselines.make(
        case.method, axes, ranks, experts, case.capacity_factor, case.backend == "ragged"
    )

    def fn(x, idx, w):
        out, dropped = base(x, idx, w)
        return out, dropped, jnp.zeros((len(axes),), jnp.int32), None

    return fn


def make_program(case: Case, direction: str, mesh, axes, experts: int):
    """jit(shard_map) of one case: (x, idx, w, ct) -> (result, dropped [R], level_rows [R, L])."""
    fn = _shard_fn(case, mesh, axes, experts)

    def fwd(x, idx, w, ct):
        out, dropped, level_rows, _ = fn(x, idx, w)
        return out, dropped[None], level_rows[None]

    def fwd_bwd(x, idx, w, ct):
        def loss(x, w):
            out, dropped, level_rows, _ = fn(x, idx, w)
            return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32)), (dropped, level_rows)

        (_, (dropped, level_rows)), (gx, gw) = jax.value_and_grad(loss, (0, 1), has_aux=True)(x, w)
        return (gx, gw), dropped[None], level_rows[None]

    body = fwd if direction == "fwd" else fwd_bwd
    spec = P(axes)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)), fn


def receive_rows(fn, mesh, axes, args) -> int | None:
    """Static receive-buffer rows of a hybridep shard (shape of d.tokens), else None."""
    spec = P(axes)
    probe = jax.shard_map(lambda x, i, w: fn(x, i, w)[3], mesh=mesh, in_specs=spec, out_specs=spec)
    shape = jax.eval_shape(probe, *args[:3])
    return None if shape is None else shape.shape[0] // mesh.devices.size


def time_call(compiled, args, warmup: int, repeats: int):
    """Median wall time of device-synchronised calls, and the last result."""
    out = None
    for _ in range(warmup):
        out = jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        out = jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times, out


def device_args(wl: BenchInputs, mesh, axes, dtype):
    sharding = NamedSharding(mesh, P(axes))
    arrays = (
        jnp.asarray(wl.x, dtype),
        jnp.asarray(wl.topk_idx),
        jnp.asarray(wl.topk_weights),
        jnp.asarray(wl.ct, dtype),
    )
    return tuple(jax.device_put(a, sharding) for a in arrays)


def make_floor(mesh, axes, rows_per_rank: int, passes: int):
    """A copy of `rows_per_rank` rows of H per rank, `passes` times (one per direction), each
    behind an optimization barrier so XLA cannot fuse the gathers away."""

    def body(x):
        t = x.shape[0]
        a = x[(jnp.arange(rows_per_rank) * 7919) % t]
        for p in range(passes - 1):
            a = jax.lax.optimization_barrier(a)
            a = a[(jnp.arange(rows_per_rank) * (7927 + p)) % rows_per_rank]
        return a

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axes), out_specs=P(axes)))


def reference_error(wl: BenchInputs, direction: str, result) -> float:
    """Max |difference| from the dropless identity-expert math, relative to the largest value."""
    w = wl.topk_weights.astype(np.float64)
    x = np.asarray(jnp.asarray(wl.x, result_dtype(result)).astype(jnp.float32), np.float64)
    if direction == "fwd":
        got, want = result, x * w.sum(-1, keepdims=True)
    else:
        got = result[0]
        ct = np.asarray(jnp.asarray(wl.ct, got.dtype).astype(jnp.float32), np.float64)
        want = ct * w.sum(-1, keepdims=True)
    got = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def result_dtype(result):
    return (result if not isinstance(result, tuple) else result[0]).dtype


def memory_bytes(compiled) -> int | None:
    try:
        mem = compiled.memory_analysis()
        return int(mem.temp_size_in_bytes + mem.output_size_in_bytes)
    except Exception:  # noqa: BLE001  (not every backend reports it)
        return None


def run(
    preset: Preset,
    devices,
    workloads,
    cases,
    *,
    directions=DIRECTIONS,
    nodes=2,
    repeats=None,
    warmup=None,
    log=print,
) -> dict:
    """Times every case on every workload and the floors; returns raw measurements."""
    from jax_hybridep.bench import metrics

    repeats = preset.repeats if repeats is None else repeats
    warmup = preset.warmup if warmup is None else warmup
    meshes = make_meshes(devices, nodes)
    dtype = jnp.dtype(preset.dtype)
    experts = preset.experts(len(devices))
    args = {
        (topo, wl.routing): device_args(wl, mesh, axes, dtype)
        for topo, (mesh, axes) in meshes.items()
        for wl in workloads
    }
    rows = []
    for case in cases:
        if case.topology not in meshes:
            continue
        mesh, axes = meshes[case.topology]
        for direction in directions:
            program, fn = make_program(case, direction, mesh, axes, experts)
            compiled = None
            for wl in workloads:
                a = args[(case.topology, wl.routing)]
                t0 = time.perf_counter()
                if compiled is None:
                    compiled = program.lower(*a).compile()
                compile_s = time.perf_counter() - t0
                median, times, (result, dropped, level_rows) = time_call(
                    compiled, a, warmup, repeats
                )
                recv = receive_rows(fn, mesh, axes, a) if case.method == "hybridep" else None
                dropped_rows = int(np.sum(np.asarray(dropped)))
                dropless = case.capacity_factor is None and (
                    case.budget is None or not dropped_rows
                )
                err = reference_error(wl, direction, result) if dropless else None
                rows.append(
                    metrics.case_row(
                        case,
                        direction,
                        wl,
                        preset,
                        nodes=nodes,
                        median=median,
                        times=times,
                        dropped=dropped_rows,
                        level_rows=np.asarray(level_rows),
                        axes=axes,
                        route=getattr(fn, "traced", {}).get("route"),
                        topology=hep.Topology.from_mesh(mesh, levels=axes),
                        recv_rows=recv,
                        memory=memory_bytes(compiled),
                        err=err,
                        compile_s=compile_s,
                    )
                )
                log(metrics.progress_line(rows[-1]))
    floors = []
    mesh, axes = meshes["flat"]
    for wl in workloads:
        received = wl.received_tokens()
        per_rank = -(-received // len(devices))
        for direction in directions:
            passes = 2 if direction == "fwd" else 4
            a = args[("flat", wl.routing)]
            compiled = make_floor(mesh, axes, per_rank, passes).lower(a[0]).compile()
            median, times, _ = time_call(compiled, a[:1], warmup, repeats)
            floors.append(metrics.floor_row(wl, preset, direction, passes, received, median, times))
            log(f"floor {wl.routing:9s} {direction:8s} {median * 1e3:9.3f} ms")
    return {"cases": rows, "floors": floors, "repeats": repeats, "warmup": warmup}
