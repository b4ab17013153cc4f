"""Main job: train a small MoE byte-level LM with optax, experts dispatched by jax_hybridep.

A decoder-only transformer (`moe_lm/model.py`) whose FFNs are `jax_hybridep.nn.MoEBlock`s
learns next-byte prediction on the Python standard library's own source (`moe_lm/data.py`;
nothing is downloaded). One `jax.jit`-compiled step does forward, backward (through
dispatch/combine's VJPs) and an AdamW update with warmup + cosine decay and global-norm clipping.
Runs on all local GPUs, or on 8 fake CPU devices when there are none; the mesh is given by --mesh
("node=2,local=4", the CPU default: a two-level topology; "ep=8"; "data=2,ep=4"; ...), and every
axis except "data" is an EP level, slow -> fast. Run from the repository root:

    python -m examples.train_moe [--steps=500] [--mesh=data=2,ep=4] [--backend=xla] ...
    python -m examples.train_moe --resume --steps=1000  # continue from the saved checkpoint
    python -m examples.train_moe --redundant_slots=1 --rebalance_every=50  # balance expert load
    bash scripts/launch_local.sh 2 --mesh=node=2,local=4  # 2 processes (docs/multihost.md)

Writes to --output_dir: metrics.json (losses per step), train_moe.png (loss curves, expert and
per-rank load; `train_moe/report.py`), checkpoint/<step>/ (orbax: model and optimizer state,
and the flags; committed atomically, see `train_moe/checkpoint.py`; with --rebalance_every
also the expert placements, `train_moe/rebalance.py`). The last line printed is
`eval loss: <value>`. Every flag is checked before a model is built (`train_moe/config.py`);
a bad flag or an unusable --resume checkpoint ends the run with one line naming it. One run holds
an --output_dir at a time (`job_runtime/output_lock.py`); SIGTERM (a scheduler's preemption) ends
a run after its current step with a committed checkpoint (`job_runtime/preemption.py`). The job:
`train_moe/job.py` (`train`, its parts beside it in `train_moe/`); the command line's job around
it: `job_runtime/run_job.py`.

Several processes (hosts) run one job on `jax.distributed` (`job_runtime/startup.py`,
`job_runtime/processes.py`): each feeds only its rows of every batch (`data.ShardFeeder`), all
write the checkpoint's shards, process 0 decides re-balancing and re-planning for all and alone
writes metrics, plot and messages.
"""

from examples.train_moe import job

if __name__ == "__main__":
    job.command_line()
