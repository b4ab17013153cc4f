"""Cross-datacenter MoE training: plan expert domains for a described cluster, then train.

The cluster: 2 datacenters x 2 nodes x 2 GPUs, played by 8 fake CPU devices as the mesh
(dc=2, node=2, local=2). Links are described by flags (WAN bandwidth shared by a DC's GPUs and
its latency, the inter-node and intra-node bandwidths). `jax_hybridep.xdc.plan` evaluates every
per-level domain size for the training example's model and picks the fastest; the example then
trains that model (the main job's `train`, `train_moe/job.py`) with the planned domains and
with plain EP and reports, per rank and step, the bytes that cross the DC level beside the model's
prediction for the same run (`cross_dc/crossing.py`). Three modes, run from the repository root:

    python -m examples.cross_dc [--steps=150] [--wan_gbps=10] [--domain_compression=10]
    python -m examples.cross_dc --sr_table [--domains=dc=2]   # SR variants side by side
    python -m examples.cross_dc --replan_every=15 --steps=90 --link_schedule=30:dc=0.65 --skew_at=45

Like the main job (`python -m examples.train_moe`) it runs as one process or as several on
`jax.distributed` (the same process flags, e.g. `MODULE=examples.cross_dc bash
scripts/launch_local.sh 2`; with two processes each one is a DC), process 0 alone printing and
writing summary.json; every flag, the output directory included, is checked before jax starts,
and an error ends the run with one line.

`--sr_table` trains plain EP, full-expert domains, SR with the persistent shared expert, with the
recomputed mean, without a shared expert, and SR with gradient compression, the same steps each.
`--replan_every` trains once with `xdc.Replanner` re-planning from the measured routing and the
link schedule, recompiling only when the plan changes; `--skew_at` skews the routing at that
step (a router bias towards experts 0 and 1, the experts of one node of DC 0). The job:
`cross_dc/job.py`; the flags, their checks and the cluster they describe: `cross_dc/settings.py`.
"""

from examples.cross_dc import job

if __name__ == "__main__":
    job.command_line()
