"""Network simulator for cross-datacenter MoE expert parallelism: plain EP vs. HybridEP.

A flow-level model (max-min fair sharing, event-driven, per-message latency and overhead,
congestion from flow counts) of one MoE layer step on `num_dcs` DCs x `gpus_per_dc`
GPUs, aggregated over the cluster's symmetry so that 1000+ DCs take seconds. Pure numpy
(matplotlib only for plots). See docs/crossdc_simulator.md.

    from jax_hybridep import sim
    c = sim.Datacenters(num_dcs=1000, dc_gbps=10)
    w = sim.MoELayer(data_bytes=48e6, expert_bytes=0.36e6)
    ep, hy = sim.step_time(c, w, 1), sim.step_time(c, w, 8)
    print(ep.total_s / hy.total_s)

Modules: `network` (links, flows, max-min, event engine), `cluster` (the inputs: datacenters,
layer, phase kinds), `messages` (the messages of each phase), `moe_step` (time of a layer step),
`policies` (domain size per DC count), `sweep` (grids, CSV, PNG), `sensitivity` (the 1000-DC gain
against each assumed constant); CLI `python -m jax_hybridep.sim`.
"""

from jax_hybridep.sim.cluster import Datacenters, MoELayer, Phase
from jax_hybridep.sim.moe_step import StepTime, step_time
from jax_hybridep.sim.network import (
    Congestion,
    Flows,
    Network,
    max_min_rates,
    simulate,
    simulate_reference,
)
from jax_hybridep.sim.policies import (
    best_domain,
    fixed_domain,
    fixed_fraction,
    lower_bound,
    planned_domain,
)
from jax_hybridep.sim.sweep import plot, read_csv, run_sweep, write_csv
from jax_hybridep.xdc.model.cost import divisors  # the realisable domain sizes, defined once

__all__ = [
    "Congestion",
    "Datacenters",
    "Flows",
    "MoELayer",
    "Network",
    "Phase",
    "StepTime",
    "best_domain",
    "divisors",
    "fixed_domain",
    "fixed_fraction",
    "lower_bound",
    "max_min_rates",
    "planned_domain",
    "plot",
    "read_csv",
    "simulate",
    "simulate_reference",
    "step_time",
    "run_sweep",
    "write_csv",
]
