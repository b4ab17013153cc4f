"""`python -m jax_hybridep.sim`: sweep EP vs. HybridEP over WAN bandwidth x DC count; table, CSV,
PNG. Defaults follow the HybridEP paper's setting (see docs/crossdc_simulator.md)."""

from __future__ import annotations

import argparse
import sys
import time

from jax_hybridep.sim.cluster import EXCHANGES, Datacenters, MoELayer
from jax_hybridep.sim.sweep import (
    BANDWIDTHS_GBPS,
    DC_COUNTS,
    DOMAINS,
    FRACTIONS,
    plot,
    run_sweep,
    write_csv,
)
from jax_hybridep.values import output_path_arg, run_command

# A flag's unit: (the field's value -> the flag's, the flag's value -> the field's).
_UNITS = {
    "": (lambda v: v, lambda v: v),
    "ms": (lambda v: v * 1e3, lambda v: v * 1e-3),
    "us": (lambda v: v * 1e6, lambda v: v * 1e-6),
    "MB": (lambda v: v / 1e6, lambda v: v * 1e6),
}
# The flags setting one number of the cluster (`Datacenters`) or of the layer (`MoELayer`):
# (flag, the field it sets, its unit, its type, help). Each defaults to its field's default.
_CLUSTER_FLAGS = (
    ("--gpus-per-dc", "gpus_per_dc", "", int, None),
    ("--gpu-gbps", "gpu_gbps", "", float, "per-GPU link to the DC, Gbit/s"),
    ("--wan-latency-ms", "wan_latency_s", "ms", float, "one-way WAN latency per message (RTT/2)"),
    ("--intra-latency-us", "intra_latency_s", "us", float, None),
    (
        "--msg-overhead-us",
        "msg_overhead_s",
        "us",
        float,
        "per-message posting cost at the sender (serialised)",
    ),
    ("--header-bytes", "header_bytes", "", float, "extra bytes per message"),
    (
        "--min-window-bytes",
        "min_window_bytes",
        "",
        float,
        "transport minimum window (floor rate = window / RTT)",
    ),
    (
        "--congestion",
        "congestion_exponent",
        "",
        float,
        "goodput exponent on links whose flows' floor rates exceed capacity (0: ideal)",
    ),
)
_LAYER_FLAGS = (
    ("--data-mb", "data_bytes", "MB", float, "D, MB per rank per all-to-all"),
    ("--expert-mb", "expert_bytes", "MB", float, "P_E, expert MB per rank"),
    (
        "--compute-ms",
        "compute_s",
        "ms",
        float,
        "forward compute not overlapping communication (backward = 2x)",
    ),
    (
        "--pre-expert-ms",
        "pre_expert_s",
        "ms",
        float,
        "Lat_PE, forward pre-expert compute hiding the all-gather (backward = 2x)",
    ),
    ("--skew", "skew", "", float, "Zipf exponent of routing over GPU index"),
    (
        "--compression",
        "compression",
        "",
        float,
        "SR compression of the forward expert all-gather, full / sent bytes (1: off; above 1 adds "
        "the shared expert's all-reduce)",
    ),
)


def _fields(args: argparse.Namespace, table) -> dict:
    """The fields `table`'s flags set, in the fields' units."""
    return {
        field: _UNITS[unit][1](getattr(args, flag[2:].replace("-", "_")))
        for flag, field, unit, _, _ in table
    }


def parser() -> argparse.ArgumentParser:
    c, w = Datacenters(num_dcs=1), MoELayer()
    p = argparse.ArgumentParser(
        prog="python -m jax_hybridep.sim",
        description="Simulate one MoE layer step (forward + backward) of plain EP and HybridEP "
        "across DCs (flow-level, max-min fair, per-message latency/overhead, congestion) over "
        "a grid of WAN bandwidths x DC counts; print the rows of 1000+ DCs (else of the largest "
        "DC count), write CSV and PNG.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    a = p.add_argument
    a(
        "--bandwidths",
        type=float,
        nargs="+",
        default=list(BANDWIDTHS_GBPS),
        help="DC uplink = downlink bandwidths, Gbit/s",
    )
    a("--dcs", type=int, nargs="+", default=list(DC_COUNTS), help="DC counts")
    a("--domains", type=int, nargs="*", default=list(DOMAINS), help="fixed-domain sizes S")
    a(
        "--p",
        type=float,
        nargs="*",
        default=list(FRACTIONS),
        dest="fractions",
        help="fixed-p fractions of cross-DC token traffic kept (S = N(1-p))",
    )
    a("--no-best", action="store_true", help="skip the best-S search")
    a("--no-planned", action="store_true", help="skip the cost model's plan (xdc.plan)")
    for flag, field, unit, kind, text in _CLUSTER_FLAGS:
        a(flag, type=kind, default=_UNITS[unit][0](getattr(c, field)), help=text)
    a(
        "--exchange",
        choices=EXCHANGES,
        default=c.exchange,
        help="token exchange: hierarchical (one cross-DC message per DC, then forwarded inside "
        "it; this package's runtime) or flat (every rank to every rank, as Tutel)",
    )
    for flag, field, unit, kind, text in _LAYER_FLAGS:
        a(flag, type=kind, default=_UNITS[unit][0](getattr(w, field)), help=text)
    a(
        "--compress-gradients",
        action="store_true",
        help="compress the backward reduce-scatter too (the runtime's gradients are exact: off)",
    )
    a("--forward-only", action="store_true")
    a("--csv", type=output_path_arg, default="crossdc_sim.csv", help="CSV path ('' to skip)")
    a("--png", type=output_path_arg, default="crossdc_sim.png", help="PNG path ('' to skip)")
    a("--quiet", action="store_true", help="no progress lines")
    return p


def _table(rows: list[dict], num_dcs: int, gpus: int) -> None:
    print(f"\n{num_dcs} DCs x {gpus} GPUs")
    print(f"{'Gbps':>6} {'policy':>16} {'S':>5} {'EP s':>10} {'hybrid s':>10} {'speedup':>8}")
    for r in rows:
        if r["num_dcs"] == num_dcs:
            name = f"{r['policy']} {r['param']}".strip()
            print(
                f"{r['dc_gbps']:>6g} {name:>16} {r['domain']:>5} {r['ep_s']:>10.4g} "
                f"{r['hybrid_s']:>10.4g} {r['speedup']:>8.3f}"
            )


# Flags checked here, by name; the rest are checked by the constructors they feed.
_FLAG_CHECKS = (
    ("bandwidths", "--bandwidths", lambda v: v > 0, "> 0"),
    ("dcs", "--dcs", lambda v: v >= 1, ">= 1"),
    ("domains", "--domains", lambda v: v >= 1, ">= 1"),
    ("fractions", "--p", lambda v: 0 <= v <= 1, "in [0, 1]"),
)


def check_args(args: argparse.Namespace) -> None:
    """ValueError naming the flag and its value for every list flag out of range."""
    for attr, flag, ok, want in _FLAG_CHECKS:
        bad = [v for v in getattr(args, attr) if not (ok(v) and v == v)]
        if bad:
            raise ValueError(f"{flag}: every value must be {want}, got {bad}")
    if not args.dcs or not args.bandwidths:
        raise ValueError("--dcs and --bandwidths need at least one value each")


def build(args: argparse.Namespace) -> tuple[Datacenters, MoELayer]:
    """The datacenters and layer the flags describe (ValueError naming the flag if one is bad)."""
    try:
        cluster = Datacenters(num_dcs=1, exchange=args.exchange, **_fields(args, _CLUSTER_FLAGS))
        workload = MoELayer(
            forward_only=args.forward_only,
            compress_gradients=args.compress_gradients,
            **_fields(args, _LAYER_FLAGS),
        )
    except ValueError as e:
        named = [f for f, field, *_ in _CLUSTER_FLAGS + _LAYER_FLAGS if f".{field} " in str(e)]
        raise ValueError(f"{' / '.join(named) or 'flags'}: {e}") from None
    return cluster, workload


def main(argv=None) -> list[dict]:
    """Parse `argv`, run the sweep, print tables, write CSV and PNG; returns the rows."""
    args = parser().parse_args(argv)
    check_args(args)
    cluster, workload = build(args)
    t0 = time.perf_counter()
    progress = None if args.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    rows = run_sweep(
        cluster,
        workload,
        args.bandwidths,
        args.dcs,
        args.domains,
        args.fractions,
        best=not args.no_best,
        planned=not args.no_planned,
        progress=progress,
    )
    elapsed = time.perf_counter() - t0
    print(f"sweep: {len(rows)} rows in {elapsed:.1f} s")
    for top in [n for n in args.dcs if n >= 1000] or [max(args.dcs)]:
        _table(rows, top, args.gpus_per_dc)
    if args.csv:
        write_csv(rows, args.csv)
        print(f"wrote {args.csv}")
    if args.png:
        plot(
            rows,
            args.png,
            title=f"D={args.data_mb:g} MB, P_E={args.expert_mb:g} MB, "
            f"{args.gpus_per_dc} GPUs/DC, congestion {args.congestion:g}, {args.exchange}"
            + (f", SR compression {args.compression:g}" if args.compression > 1 else ""),
        )
        print(f"wrote {args.png}")
    return rows


if __name__ == "__main__":
    run_command(main, "python -m jax_hybridep.sim")
