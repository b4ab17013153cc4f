"""The benchmark's command line and its in-process entry point `benchmark(...)`."""

from __future__ import annotations

import argparse
import datetime
import platform
import sys

import jax

import jax_hybridep as hep
from jax_hybridep import fp8, values
from jax_hybridep.bench import cli, metrics, report, runner
from jax_hybridep.bench.workloads import PRESETS, ROUTINGS, make_inputs

METHODS = ("hybridep", "gshard", "maxtext", "worst_case")
DEFAULT_CAPACITIES = (None, 1.25, 2.0, runner.Budget(2.0))
NATIVE = "native"  # --wire_dtype: tokens travel in the preset's dtype


def parse_capacities(text: str):
    """'dropless' -> None, 'budget=F' -> runner.Budget(F), a number -> capacity factor f."""
    try:
        return cli.capacity_list(text)
    except argparse.ArgumentTypeError as err:
        raise ValueError(str(err)) from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jax_hybridep.bench",
        description=(
            "Time dispatch + combine (forward, forward + backward) of jax_hybridep against GShard, "
            "MaxText and worst-case all_to_all baselines on the devices present (fake CPU devices "
            "unless GPUs are present). Prints a table, writes JSON and a PNG."
        ),
    )
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="cpu",
        help="sizes: tiny (CI smoke), cpu (2-core machines), hybridep (GPU only)",
    )
    p.add_argument(
        "--devices",
        type=cli.positive_int,
        default=None,
        help="devices to use (default: the preset's on CPU, all GPUs on GPU); on CPU "
        "this many fake devices are created",
    )
    p.add_argument(
        "--nodes",
        type=cli.positive_int,
        default=2,
        help="nodes of the hierarchical topology (node x local mesh)",
    )
    p.add_argument(
        "--routings",
        type=cli.choice_list(ROUTINGS),
        default=list(ROUTINGS),
        help=f"subset of {ROUTINGS}",
    )
    p.add_argument(
        "--capacities",
        type=cli.capacity_list,
        default=list(DEFAULT_CAPACITIES),
        help="comma list: 'dropless', capacity factors f, and/or 'budget=F' (dropless with the "
        "opt-in DispatchConfig.row_budget = ceil(F * T * K) rows per rank; overflow is dropped "
        "and counted; compared with the dropless baselines)",
    )
    p.add_argument(
        "--methods",
        type=cli.choice_list(METHODS),
        default=list(METHODS),
        help=f"subset of {METHODS}",
    )
    p.add_argument(
        "--backends",
        type=cli.choice_list(runner.HYBRIDEP_BACKENDS),
        default=["ffi", "xla"],
        help="hybridep backends",
    )
    p.add_argument(
        "--topologies", type=cli.choice_list(runner.TOPOLOGIES), default=list(runner.TOPOLOGIES)
    )
    p.add_argument(
        "--directions", type=cli.choice_list(runner.DIRECTIONS), default=list(runner.DIRECTIONS)
    )
    p.add_argument(
        "--variants",
        type=cli.choice_list(runner.VARIANTS),
        default=["fusible"],
        help="hybridep rows straight into combine ('fusible'; XLA may fuse the xla "
        "backend's expansion away) and/or through an optimization_barrier "
        "('barrier'; every backend materialises them)",
    )
    p.add_argument(
        "--zero-padding",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="hybridep's DispatchConfig.zero_padding (--no-zero-padding: rows past "
        "the groups unwritten)",
    )
    p.add_argument(
        "--wire_dtype",
        type=cli.choice_list((NATIVE, *fp8.WIRE_DTYPES)),
        default=[NATIVE],
        help=f"comma list of hybridep's DispatchConfig.wire_dtype, each run side by side: "
        f"'{NATIVE}' (the preset's dtype) and/or {', '.join(fp8.WIRE_DTYPES)}",
    )
    p.add_argument(
        "--repeats", type=cli.positive_int, default=None, help="timed calls (median reported)"
    )
    p.add_argument("--warmup", type=cli.nonnegative_int, default=None, help="untimed calls first")
    p.add_argument(
        "--json", type=cli.output_path, default="bench.json", help="JSON output path ('' to skip)"
    )
    p.add_argument(
        "--png", type=cli.output_path, default="bench.png", help="PNG chart path ('' to skip)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--keep-freed-memory",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="tell glibc malloc to keep freed memory in the process, so XLA's per-call buffers "
        "are not faulted in from the OS on every call (all methods and the floor alike)",
    )
    return p


def benchmark(
    preset_name="tiny",
    devices=None,
    *,
    routings=ROUTINGS,
    capacities=DEFAULT_CAPACITIES,
    methods=METHODS,
    backends=("ffi", "xla"),
    topologies=("flat", "hierarchical"),
    directions=runner.DIRECTIONS,
    variants=("fusible",),
    zero_padding=True,
    wire_dtypes=(None,),
    repeats=None,
    warmup=None,
    nodes=2,
    seed=0,
    json_path=None,
    png_path=None,
    command=None,
    keep_freed_memory=False,
    log=print,
) -> dict:
    """Runs the benchmark on `devices` (default: the preset's count of `jax.devices()`)."""
    for name, path in (("json_path", json_path), ("png_path", png_path)):
        if path:  # checked before anything runs
            values.check_output_path(name, path)
    malloc_tuned = runner.keep_freed_memory() if keep_freed_memory else False
    preset = PRESETS[values.check_str("preset_name", preset_name, sorted(PRESETS))]
    all_devices = jax.devices()
    platform_name = all_devices[0].platform
    if preset.gpu_only and platform_name != "gpu":
        raise SystemExit(
            f"preset {preset_name!r} (4096 tokens/rank, hidden 7168) is for GPUs only; this "
            f"machine has {platform_name} devices. Use --preset=cpu or --preset=tiny."
        )
    if devices is None:
        n = preset.devices if platform_name == "cpu" and preset.devices else len(all_devices)
        devices = all_devices[:n]
    devices = list(devices)
    unknown = set(methods) - set(METHODS)
    if unknown:
        raise SystemExit(f"unknown methods {sorted(unknown)}; choose from {METHODS}")
    workloads = [make_inputs(preset, len(devices), r, seed) for r in routings]
    cases = runner.build_cases(
        capacities,
        methods,
        backends,
        topologies,
        platform_name == "gpu",
        variants,
        zero_padding,
        wire_dtypes,
    )
    res = runner.run(
        preset,
        devices,
        workloads,
        cases,
        directions=directions,
        nodes=nodes,
        repeats=repeats,
        warmup=warmup,
        log=log,
    )
    metrics.add_ratios(res["cases"], res["floors"])
    doc = {
        "environment": {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "jax_version": jax.__version__,
            "jax_hybridep_version": hep.__version__,
            "python": platform.python_version(),
            "platform": platform_name,
            "num_devices": len(devices),
            "devices": [str(d) for d in devices],
            "command": command or " ".join(sys.argv),
            "malloc_keeps_freed_memory": malloc_tuned,
        },
        "workload": {
            "preset": preset.name,
            "tokens_per_rank": preset.tokens,
            "hidden": preset.hidden,
            "experts": preset.experts(len(devices)),
            "local_experts": preset.local_experts,
            "top_k": preset.top_k,
            "dtype": preset.dtype,
            "ranks": len(devices),
            "nodes": nodes,
            "repeats": res["repeats"],
            "warmup": res["warmup"],
            "seed": seed,
            "routings": list(routings),
            "variants": list(variants),
            "zero_padding": zero_padding,
            "wire_dtypes": list(wire_dtypes),
        },
        "definitions": {"metrics": metrics.__doc__, "baselines": runner.baselines.__doc__},
        "cases": res["cases"],
        "floors": res["floors"],
    }
    if json_path:
        report.write_json(doc, json_path)
    if png_path:
        report.write_png(doc, png_path)
    return doc


# The flags `benchmark` takes as they are parsed, under their own names.
_AS_GIVEN = (
    "routings",
    "capacities",
    "methods",
    "backends",
    "topologies",
    "directions",
    "variants",
    "zero_padding",
    "repeats",
    "warmup",
    "nodes",
    "seed",
    "keep_freed_memory",
)


def main(argv=None) -> dict:
    args = parser().parse_args(argv)
    doc = benchmark(
        args.preset,
        wire_dtypes=[None if w == NATIVE else w for w in args.wire_dtype],
        json_path=args.json or None,
        png_path=args.png or None,
        command=" ".join(["python -m jax_hybridep.bench", *(argv or sys.argv[1:])]),
        **{name: getattr(args, name) for name in _AS_GIVEN},
    )
    print(report.table(doc))
    if args.json:
        print(f"wrote {args.json}")
    if args.png:
        print(f"wrote {args.png}")
    return doc
