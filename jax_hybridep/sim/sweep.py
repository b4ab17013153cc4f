"""Sweeps of EP vs. HybridEP step time over WAN bandwidth x DC count, with CSV and PNG output.

Policies for the DC-level domain size S at each DC count N:
* `fixed_domain` (param S0): S = the largest divisor of N not above S0;
* `fixed_p` (param p): S = the divisor of N nearest N * (1 - p), a fraction p of the cross-DC
  token traffic remains, so the domain grows with N;
* `best`: the fastest S over all divisors of N;
* `planned`: the S that `xdc.plan`, the closed-form cost model, picks for the same cluster.
"""

from __future__ import annotations

import csv
import dataclasses
from collections.abc import Callable, Iterable

import numpy as np

from jax_hybridep.sim.cluster import Datacenters, MoELayer
from jax_hybridep.sim.moe_step import StepTime, check_inputs, step_time
from jax_hybridep.sim.policies import best_domain, fixed_domain, fixed_fraction, planned_domain
from jax_hybridep.values import (
    check_bool,
    check_ints,
    check_output_path,
    check_real,
    make_parent_dirs,
)

BANDWIDTHS_GBPS = (0.1, 1.0, 10.0, 100.0)
DC_COUNTS = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1000, 1024)
DOMAINS = (2, 4, 8)
FRACTIONS = (0.5, 0.9)

FIELDS = (
    "dc_gbps",
    "num_dcs",
    "gpus",
    "policy",
    "param",
    "domain",
    "ep_s",
    "hybrid_s",
    "speedup",
    "ep_wan_mb",
    "hybrid_wan_mb",
    "ep_peers",
    "hybrid_peers",
)


def run_sweep(
    base: Datacenters,
    workload: MoELayer,
    bandwidths: Iterable[float] = BANDWIDTHS_GBPS,
    dc_counts: Iterable[int] = DC_COUNTS,
    domains: Iterable[int] = DOMAINS,
    fractions: Iterable[float] = FRACTIONS,
    best: bool = True,
    planned: bool = True,
    progress: Callable[[str], None] | None = None,
) -> list[dict]:
    """One row per (bandwidth, DC count, policy): EP time, hybrid time, speedup.

    Args:
      base: the datacenters; their `num_dcs` and `dc_gbps` are replaced by the sweep's.
      workload: the layer's sizes and compute.
      bandwidths: DC uplink/downlink bandwidths, Gbit/s.
      dc_counts: numbers of DCs.
      domains: S0 values of the fixed-domain policy.
      fractions: p values of the fixed-p policy.
      best: also report the best S over all divisors.
      planned: also report the cost model's choice of S (`planned_domain`).
      progress: called with a short line after each (bandwidth, DC count).

    Returns:
      Rows (dicts with the keys `FIELDS`).
    """
    check_inputs(base, workload, ("base", "workload"))
    bandwidths = _listed("bandwidths", bandwidths)
    for i, b in enumerate(bandwidths):
        check_real(f"bandwidths[{i}]", b, positive=True)
    dc_counts = check_ints("dc_counts", _listed("dc_counts", dc_counts), 1)
    domains = check_ints("domains", _listed("domains", domains), 1, min_len=0)
    fractions = _listed("fractions", fractions)
    for i, p in enumerate(fractions):
        check_real(f"fractions[{i}]", p, 0.0, 1.0)
    check_bool("best", best)
    check_bool("planned", planned)
    if progress is not None and not callable(progress):
        raise TypeError(f"progress must be a callable or None, got {progress!r}")
    rows = []
    for bw in bandwidths:
        for n in dc_counts:
            c = dataclasses.replace(base, num_dcs=n, dc_gbps=bw)
            cache: dict[int, StepTime] = {}

            def timed(c_, w_, s, cache=cache):
                if s not in cache:
                    cache[s] = step_time(c_, w_, s)
                return cache[s]

            ep = timed(c, workload, 1)
            choices = [
                ("fixed_domain", s0, timed(c, workload, fixed_domain(n, s0))) for s0 in domains
            ]
            choices += [("fixed_p", p, timed(c, workload, fixed_fraction(n, p))) for p in fractions]
            if best:
                choices.append(("best", "", best_domain(c, workload, step=timed)))
            if planned:
                choices.append(("planned", "", timed(c, workload, planned_domain(c, workload))))
            for policy, param, hy in choices:
                rows.append(
                    dict(
                        dc_gbps=bw,
                        num_dcs=n,
                        gpus=c.num_ranks,
                        policy=policy,
                        param=param,
                        domain=hy.domain,
                        ep_s=ep.total_s,
                        hybrid_s=hy.total_s,
                        speedup=ep.total_s / hy.total_s,
                        ep_wan_mb=ep.wan_bytes_per_gpu / 1e6,
                        hybrid_wan_mb=hy.wan_bytes_per_gpu / 1e6,
                        ep_peers=ep.peers_per_gpu,
                        hybrid_peers=hy.peers_per_gpu,
                    )
                )
            if progress:
                gains = " ".join(
                    f"{r['policy']}{r['param']}:{r['speedup']:.2f}" for r in rows[-len(choices) :]
                )
                progress(f"{bw:g} Gbps, {n} DCs: EP {ep.total_s:.4g} s; {gains}")
    return rows


def _listed(name: str, values) -> list:
    """values (an iterable, not a str) as a list."""
    if isinstance(values, str | bytes) or not isinstance(values, Iterable):
        raise TypeError(f"{name} must be an iterable of numbers, got {values!r}")
    return list(values)


def write_csv(rows: list[dict], path: str, fields: tuple[str, ...] = FIELDS) -> None:
    """Rows as CSV with a header in `fields` order, floats to 6 significant digits (missing
    directories above `path` are created)."""
    check_output_path("path", path)
    make_parent_dirs(path)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow(
                {k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()}
            )


def read_csv(path: str) -> list[dict]:
    """Rows written by `write_csv`, numbers parsed back (ValueError naming the file, line and
    column for anything else)."""
    out = []
    with open(path, newline="") as f:
        for line, row in enumerate(csv.DictReader(f), start=2):
            for kind, keys in (
                (float, ("dc_gbps", "ep_s", "hybrid_s", "speedup", "ep_wan_mb", "hybrid_wan_mb")),
                (int, ("num_dcs", "gpus", "domain", "ep_peers", "hybrid_peers")),
            ):
                for k in keys:
                    try:
                        row[k] = kind(row[k])
                    except (KeyError, TypeError, ValueError):
                        raise ValueError(
                            f"{path}:{line}: not a sweep CSV written by write_csv: column {k!r} "
                            f"is {row.get(k)!r}"
                        ) from None
            out.append(row)
    return out


def _series(rows: list[dict]) -> list[tuple[str, str]]:
    seen = []
    for r in rows:
        key = (r["policy"], str(r["param"]))
        if key not in seen:
            seen.append(key)
    return seen


def plot(rows: list[dict], path: str, title: str = "") -> None:
    """Speedup (EP time / hybrid time) vs. DC count, a line per bandwidth, a panel per policy."""
    if not rows:
        raise ValueError("plot needs at least one row (run_sweep's rows)")
    check_output_path("path", path)
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on servers
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    series = _series(rows)
    cols = min(3, len(series))
    nrows = -(-len(series) // cols)
    fig, axes = plt.subplots(
        nrows, cols, figsize=(4.2 * cols, 3.4 * nrows), squeeze=False, sharex=True
    )
    labels = {
        "fixed_domain": "fixed domain S={}",
        "fixed_p": "fixed p={}",
        "best": "best S{}",
        "planned": "planned S (cost model){}",
    }
    for ax, (policy, param) in zip(axes.ravel(), series, strict=False):
        sel = [r for r in rows if r["policy"] == policy and str(r["param"]) == param]
        for bw in sorted({r["dc_gbps"] for r in sel}):
            pts = sorted((r["num_dcs"], r["speedup"]) for r in sel if r["dc_gbps"] == bw)
            ax.plot(*zip(*pts, strict=True), marker="o", ms=3, label=f"{bw:g} Gbps")
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")  # gains span 0.5x to 100x+ between 2 and 1000 DCs
        label = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
        ax.yaxis.set_major_formatter(label)
        lo, hi = ax.get_ylim()
        # Label minor ticks only when the panel spans too little for decade ticks to show.
        ax.yaxis.set_minor_formatter(label if hi / lo < 20 else matplotlib.ticker.NullFormatter())
        ax.set_title(labels[policy].format(param))
        ax.set_xlabel("DCs")
        ax.set_ylabel("speedup over EP")
        ax.grid(True, which="both", alpha=0.3)
    for ax in axes.ravel()[len(series) :]:
        ax.set_visible(False)
    for row, col in np.ndindex(axes.shape):  # tick labels under each column's lowest panel
        below = row + 1 < nrows and axes[row + 1, col].get_visible()
        axes[row, col].xaxis.set_tick_params(labelbottom=not below)
    axes[0, 0].legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    make_parent_dirs(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
