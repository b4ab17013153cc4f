"""Main job: train a small MoE byte-level LM with optax, experts dispatched by jax_hybridep.

A decoder-only transformer (`moe_lm/lm_model.py`) whose FFNs are `jax_hybridep.nn.MoEBlock`s
learns next-byte prediction on the Python standard library's own source (`moe_lm/lm_data.py`;
nothing is downloaded). One `jax.jit`-compiled step does forward, backward (through
dispatch/combine's VJPs) and an AdamW update with warmup + cosine decay and global-norm clipping.
Runs on all local GPUs, or on 8 fake CPU devices when there are none; the mesh is given by --mesh
("node=2,local=4", the CPU default: a two-level topology; "ep=8"; "data=2,ep=4"; ...), and every
axis except "data" is an EP level, slow -> fast.

    python examples/train_moe.py [--steps=500] [--mesh=data=2,ep=4] [--backend=xla] ...
    python examples/train_moe.py --resume --steps=1000  # continue from the saved checkpoint
    python examples/train_moe.py --redundant_slots=1 --rebalance_every=50  # balance expert load
    bash scripts/launch_local.sh 2 --mesh=node=2,local=4  # 2 processes (docs/multihost.md)

Writes to --output_dir: metrics.json (losses per step), train_moe.png (loss curves, expert and
per-rank load; `main_job/train_report.py`), checkpoint/<step>/ (orbax: model and optimizer state,
and the flags; committed atomically, see `main_job/train_checkpoint.py`; with --rebalance_every
also the expert placements, `main_job/rebalance_hook.py`). The last line printed is
`eval loss: <value>`. Every flag is checked before a model is built (`main_job/train_config.py`);
a bad flag or an unusable --resume checkpoint ends the run with one line naming it. One run holds
an --output_dir at a time (`job_runtime/output_lock.py`); SIGTERM (a scheduler's preemption) ends
a run after its current step with a committed checkpoint (`job_runtime/preemption.py`). The job:
`main_job/main_job.py` (`train`, its parts beside it in `main_job/`); the command line's job around
it: `job_runtime/run_job.py`.

Several processes (hosts) run one job on `jax.distributed` (`job_runtime/startup.py`,
`job_runtime/processes.py`): each feeds only its rows of every batch (`lm_data.ShardFeeder`), all
write the checkpoint's shards, process 0 decides re-balancing and re-planning for all and alone
writes metrics, plot and messages.
"""

import os
import sys

if __name__ == "__main__":
    # Run as a script, sys.path[0] is this folder: the repository root takes its place, so that
    # the examples import as one package (`examples.main_job`, ...), each module once.
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    from examples.main_job import main_job

    main_job.command_line()
