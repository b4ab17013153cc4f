"""Where one benchmark case spends its time: `python -m jax_hybridep.bench.profile`.

Runs one hybridep case of the benchmark (same program, same inputs) under `jax.profiler.trace`
and sums the trace's per-op events (XLA:CPU records one per thunk and device) by HLO instruction:
each custom call is named by its FFI target, each XLA fusion by its name and result shape. Times
are wall time per step, summed over the devices' threads and divided by the device count, so they
add up to about the step's wall time when the devices take turns on few cores. An exchange's work
(every rank's write and read steps) runs inside the last rank to arrive, so it shows up in that
rank's event. Measured in-process, so run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import collections
import glob
import re
import sys
import tempfile
import time

from jax_hybridep.bench import cli
from jax_hybridep.values import make_parent_dirs


def op_labels(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> label: 'ffi <target>' for custom calls, 'xla <name> <shape>' for
    fusions and other ops of the entry computation."""
    labels = {}
    entry = hlo_text[hlo_text.find("\nENTRY") :]
    targets = re.findall(r'custom_call_target="jax_hybridep_(\w+)"', entry)
    for line in entry.splitlines():
        m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([\w\-]+)\(", line)
        if not m:
            continue
        name, shape, op = m.groups()
        target = re.search(r'custom_call_target="jax_hybridep_(\w+)"', line)
        if target:
            t = target.group(1)
            labels[name] = f"ffi {t}" + (f" ({name})" if targets.count(t) > 1 else "")
        elif op not in ("parameter", "constant", "get-tuple-element", "tuple", "bitcast"):
            labels[name] = f"xla {name} {re.sub(r'\{[^}]*\}', '', shape)}"
    return labels


def aggregate(xplane_path: str, labels: dict[str, str]) -> dict[str, float]:
    """Seconds per label summed over every event of the trace."""
    from jax_hybridep import compat  # noqa: PLC0415  (jax starts after the fake devices are set)

    totals: dict[str, float] = collections.defaultdict(float)
    for plane in compat.profile_data(xplane_path).planes:
        for line in plane.lines:
            for event in line.events:
                label = labels.get(event.name)
                if label is not None:
                    totals[label] += event.duration_ns * 1e-9
    return dict(totals)


def profile(
    capacity=1.25,
    backend="ffi",
    topology="flat",
    routing="uniform",
    steps=3,
    preset_name="cpu",
    zero_padding=True,
):
    """Returns (median step seconds, {label: seconds per step per device}, hlo text)."""
    import jax
    import jax.numpy as jnp

    from jax_hybridep.bench import runner, workloads

    preset = workloads.PRESETS[preset_name]
    devices = jax.devices()[: preset.devices]
    wl = workloads.make_inputs(preset, len(devices), routing)
    mesh, axes = runner.make_meshes(devices, 2)[topology]
    args = runner.device_args(wl, mesh, axes, jnp.dtype(preset.dtype))
    budget = capacity if isinstance(capacity, runner.Budget) else None
    factor = None if budget is not None else capacity
    case = runner.Case("hybridep", backend, topology, factor, budget, zero_padding=zero_padding)
    experts = preset.experts(len(devices))
    program, _ = runner.make_program(case, "fwd+bwd", mesh, axes, experts)
    compiled = program.lower(*args).compile()
    hlo = compiled.as_text()
    median, _, _ = runner.time_call(compiled, args, warmup=1, repeats=steps)
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(steps):
                jax.block_until_ready(compiled(*args))
        xplane = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0]
        totals = aggregate(xplane, op_labels(hlo))
    per_device = {k: v / steps / len(devices) for k, v in totals.items()}
    return median, per_device, hlo


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m jax_hybridep.bench.profile", description=__doc__)
    p.add_argument("--capacity", default="1.25", help="'dropless', a factor f, or 'budget=F'")
    p.add_argument("--backend", default="ffi", choices=("ffi", "xla"))
    p.add_argument("--topology", default="flat", choices=("flat", "hierarchical"))
    p.add_argument("--routing", default="uniform", choices=("uniform", "deepseek", "skewed"))
    p.add_argument("--steps", type=cli.positive_int, default=3)
    p.add_argument(
        "--hlo", type=cli.output_path, default="", help="also write the compiled HLO here"
    )
    p.add_argument(
        "--zero-padding",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="DispatchConfig.zero_padding",
    )
    p.add_argument(
        "--keep-freed-memory",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="as in the benchmark: glibc malloc keeps freed memory (runner.keep_freed_memory)",
    )
    args = p.parse_args(argv)
    try:
        (capacity,) = cli.capacity_list(args.capacity)
    except (argparse.ArgumentTypeError, ValueError) as err:
        p.error(f"--capacity: {err}")
    from jax_hybridep.bench import runner

    if args.keep_freed_memory:
        runner.keep_freed_memory()

    t0 = time.perf_counter()
    median, per_device, hlo = profile(
        capacity,
        args.backend,
        args.topology,
        args.routing,
        args.steps,
        zero_padding=args.zero_padding,
    )
    if args.hlo:
        make_parent_dirs(args.hlo)
        with open(args.hlo, "w") as f:
            f.write(hlo)
    total = sum(per_device.values())
    print(
        f"{args.backend}/{args.topology} {args.routing} capacity={args.capacity} fwd+bwd: "
        f"median step {median * 1e3:.1f} ms (untraced); traced ops {total * 1e3:.1f} ms per "
        f"device per step ({time.perf_counter() - t0:.0f} s in all)"
    )
    print(f"{'ms/step/device':>14s} {'share':>6s}  op")
    for label, s in sorted(per_device.items(), key=lambda kv: -kv[1]):
        if s * 1e3 >= 0.05:
            print(f"{s * 1e3:14.2f} {s / total:6.1%}  {label}")
    return median, per_device


if __name__ == "__main__":
    if "-h" not in sys.argv and "--help" not in sys.argv:
        import jax

        jax.config.update("jax_num_cpu_devices", 8)
    main()
