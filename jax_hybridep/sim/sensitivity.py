"""How the 1000-DC gain depends on each constant the simulator assumes rather than measures.

`python -m jax_hybridep.sim.sensitivity` varies one constant at a time from the defaults
(`Datacenters`, `MoELayer`): the congestion exponent, the per-message posting cost and the one-way
WAN latency, and at each value and bandwidth reports EP's step time and the gain of a fixed domain,
of fixed p and of the best domain. Writes a CSV (docs/crossdc_simulator.md records one).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Iterable

from jax_hybridep.sim.cluster import Datacenters, MoELayer
from jax_hybridep.sim.moe_step import step_time
from jax_hybridep.sim.policies import best_domain, fixed_domain, fixed_fraction
from jax_hybridep.sim.sweep import BANDWIDTHS_GBPS, write_csv
from jax_hybridep.values import output_path_arg, run_command

# Each assumed constant (a `Datacenters` field) and the values tried, the default among them.
CONSTANTS = {
    "congestion_exponent": (0.0, 0.05, 0.1, 0.2, 0.3),
    "msg_overhead_s": (0.0, 1e-6, 5e-6, 20e-6),
    "wan_latency_s": (0.5e-3, 5e-3, 50e-3),
}
FIELDS = (
    "constant",
    "value",
    "dc_gbps",
    "num_dcs",
    "policy",
    "param",
    "domain",
    "ep_s",
    "hybrid_s",
    "speedup",
)


def sensitivity(
    base: Datacenters,
    layer: MoELayer,
    constants: dict[str, Iterable[float]] = CONSTANTS,
    bandwidths: Iterable[float] = BANDWIDTHS_GBPS,
    num_dcs: int = 1000,
    domain: int = 8,
    fraction: float = 0.9,
) -> list[dict]:
    """One row per (constant, value, bandwidth, policy): fixed domain `domain`, fixed p
    `fraction`, best S; the other constants stay at `base`'s values."""
    unknown = sorted(set(constants) - {f.name for f in dataclasses.fields(Datacenters)})
    if unknown:
        raise ValueError(f"constants {unknown} are not Datacenters fields")
    rows = []
    for name, values in constants.items():
        for value in values:
            for bw in bandwidths:
                c = dataclasses.replace(base, num_dcs=num_dcs, dc_gbps=bw, **{name: value})
                ep = step_time(c, layer, 1)
                choices = (
                    ("fixed_domain", domain, step_time(c, layer, fixed_domain(num_dcs, domain))),
                    ("fixed_p", fraction, step_time(c, layer, fixed_fraction(num_dcs, fraction))),
                    ("best", "", best_domain(c, layer)),
                )
                for policy, param, hy in choices:
                    rows.append(
                        dict(
                            constant=name,
                            value=value,
                            dc_gbps=bw,
                            num_dcs=num_dcs,
                            policy=policy,
                            param=param,
                            domain=hy.domain,
                            ep_s=ep.total_s,
                            hybrid_s=hy.total_s,
                            speedup=ep.total_s / hy.total_s,
                        )
                    )
    return rows


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(
        prog="python -m jax_hybridep.sim.sensitivity",
        description="The 1000-DC gain of HybridEP over EP against each assumed constant "
        "(congestion exponent, per-message cost, WAN latency), one at a time from the defaults.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--dcs", type=int, default=1000, help="DC count")
    p.add_argument("--bandwidths", type=float, nargs="+", default=list(BANDWIDTHS_GBPS))
    p.add_argument("--expert-mb", type=float, default=MoELayer().expert_bytes / 1e6)
    p.add_argument(
        "--csv", type=output_path_arg, default="sensitivity.csv", help="CSV path ('' to skip)"
    )
    args = p.parse_args(argv)
    if args.dcs < 1 or min(args.bandwidths) <= 0 or not args.expert_mb >= 0:
        raise ValueError(
            f"need --dcs >= 1, --bandwidths > 0 and --expert-mb >= 0; got --dcs={args.dcs}, "
            f"--bandwidths={args.bandwidths}, --expert-mb={args.expert_mb}"
        )
    t0 = time.perf_counter()
    layer = MoELayer(expert_bytes=args.expert_mb * 1e6)
    rows = sensitivity(Datacenters(num_dcs=1), layer, bandwidths=args.bandwidths, num_dcs=args.dcs)
    print(f"{len(rows)} rows in {time.perf_counter() - t0:.1f} s")
    print(f"{'constant':>20} {'value':>8} {'Gbps':>6} {'policy':>13} {'S':>5} {'speedup':>8}")
    for r in rows:
        print(
            f"{r['constant']:>20} {r['value']:>8g} {r['dc_gbps']:>6g} "
            f"{r['policy'] + str(r['param']):>13} {r['domain']:>5} {r['speedup']:>8.3f}"
        )
    if args.csv:
        write_csv(rows, args.csv, FIELDS)
        print(f"wrote {args.csv}")
    return rows


if __name__ == "__main__":
    run_command(main, "python -m jax_hybridep.sim.sensitivity")
