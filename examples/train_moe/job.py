"""The main job (its command: `python -m examples.train_moe`, `__main__.py`, whose docstring is
its --help): `train` trains the example MoE LM (`examples/moe_lm/`) as a `TrainConfig` says and
writes its metrics, plot and checkpoint; `main` runs it as the command line's job
(`job_runtime/run_job.py`).

`train`, in order: the corpus compared between processes, every flag checked (`config.py`), the
output directory taken (`job_runtime/output_lock.py`), a --resume checkpoint checked on disk
(`checkpoint.py`), the model built and its state placed (re-balancing: `rebalance.py`;
re-planning: `replan.py`), the loop (`loop.py`; the compiled steps: `step.py`), the last
checkpoint and the outputs (`report.py`). The cross-DC job (`examples/cross_dc/`) calls `train`
once per run it compares.
"""

from __future__ import annotations

import os

import jax
from absl import app, logging
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from rich.console import Console

from examples.job_runtime import output_lock, preemption, startup
from examples.job_runtime.errors import (
    FlagError,
    ResumeError,  # noqa: F401  (re-exported: tests catch it here)
)
from examples.job_runtime.processes import Processes
from examples.job_runtime.run_job import run_job
from examples.job_runtime.startup import global_devices
from examples.moe_lm.data import ByteData
from examples.moe_lm.model import MoETransformer, make_mesh
from examples.train_moe import checkpoint, replan
from examples.train_moe.config import TrainConfig, check_config, flag_values
from examples.train_moe.flags import config_from_flags, define_flags
from examples.train_moe.loop import loop
from examples.train_moe.rebalance import Rebalancer
from examples.train_moe.report import metrics_of, write_outputs
from examples.train_moe.step import make_optimizer

NAME = "train_moe"  # the command's and the package's name; it starts the lines the job ends with

# The flags that fix the shapes of the model and optimizer state (a checkpoint needs them equal;
# the domain flags fix the shapes of the SR and error-feedback state).
MODEL_FLAGS = (
    "d_model",
    "d_ff",
    "layers",
    "experts",
    "domains",
    "domain_compression",
    "domain_shared",
    "grad_compression",
)


def mesh_spec(mesh) -> str:
    """The mesh as --mesh spells it ("node=2,local=4")."""
    return ",".join(f"{name}={size}" for name, size in mesh.shape.items())


def train(
    cfg: TrainConfig,
    console: Console | None = None,
    on_compile=None,
    hook=None,
    processes: Processes | None = None,
    job: str = NAME,
) -> dict:
    """Trains (or resumes) per `cfg`, writes metrics/plot/checkpoint, returns the metrics dict.

    Raises FlagError (a bad flag, before any model is built; or `cfg.output_dir` in use by
    another run, `job_runtime/output_lock.py`) or ResumeError (--resume cannot use the
    checkpoint), each naming what is wrong; `preemption.Stopped` when a SIGTERM stopped the run
    (the command line's job only) after committing a checkpoint. `on_compile`, if given, is
    called with the compiled train step's HLO text (e.g. to read its collectives,
    `jax_hybridep.traffic`).
    `hook`: a `replan.ReplanHook` (made from `cfg` when `replan_every` is set), asked after
    every step whether to switch domains. `processes`: this process's place in a job of
    several (None: `startup.current()`); every process calls `train`, and only process 0
    writes metrics and plot (every process writes its checkpoint shards). `job`: the name the
    output directory's lock gives this run (the cross-DC job passes its own).
    """
    processes = processes or startup.current()
    console = console or Console(soft_wrap=True)
    data = ByteData.load()
    if processes.count > 1:  # each host builds the corpus from its own Python's stdlib
        corpus = processes.exchange("corpus", data.digest())
        if len(set(corpus)) > 1:
            raise FlagError(
                f"the training text differs between processes (digests {corpus}): every host "
                "must run the same Python, whose stdlib is the corpus"
            )
    devices = global_devices()
    check_config(cfg, devices, data)
    # One run per output directory, from here to the end (before anything is read or built).
    lock, note = output_lock.acquire(os.path.abspath(cfg.output_dir), job, processes)
    try:
        if note is not None:
            console.print(note, highlight=False)
        return _train(cfg, console, on_compile, hook, processes, data, devices)
    finally:
        if lock is not None:
            lock.release()


def _train(cfg, console, on_compile, hook, processes, data, devices) -> dict:
    """`train` once the output directory is this run's."""
    mesh, topology = make_mesh(cfg.mesh, devices)
    ckpt_dir = os.path.join(os.path.abspath(cfg.output_dir), "checkpoint")
    metrics_path = os.path.join(cfg.output_dir, "metrics.json")
    meta = dict(flag_values(cfg), processes=processes.count, mesh_shape=mesh_spec(mesh))
    if cfg.resume:  # what can be checked on disk is, before the model is built
        start = checkpoint.latest(ckpt_dir)
        saved = checkpoint.read_saved(ckpt_dir, start)
        defaults = flag_values(TrainConfig())
        checkpoint.check_resume_flags(ckpt_dir, start, saved.meta, meta, defaults)
        old_metrics = checkpoint.read_metrics(metrics_path)
    model_cfg = cfg.built_model
    if hook is None and cfg.replan_every:
        hook = replan.ReplanHook.from_config(cfg, model_cfg, mesh, topology)
    if hook is not None:
        hook.processes = processes
        model_cfg = hook.model_config
    model = MoETransformer(model_cfg, mesh, topology, rngs=nnx.Rngs(cfg.seed))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    # Dense parameters replicate; the MoE block's own sharding annotations place its experts.
    params = jax.device_put(params, nnx.get_named_sharding(params, mesh))
    rest = jax.device_put(rest, nnx.get_named_sharding(rest, mesh))
    tx = make_optimizer(cfg)
    # Eager init: Adam's moments take their parameter's sharding (under jax.jit, zeros that
    # depend on no input came out replicated, so every step all-gathered the experts' moments).
    # Scalars (Adam's count) come out on one device; replicate them so the checkpoint's restore
    # target names the mesh for every leaf.
    replicated = NamedSharding(mesh, P())
    opt_state = jax.tree.map(
        lambda a: a if isinstance(a.sharding, NamedSharding) else jax.device_put(a, replicated),
        tx.init(params),
    )

    history = dict(train=[], eval=[], rebalances=[])
    balancer = Rebalancer(cfg, graphdef, params, rest, tx, processes)
    if not cfg.resume:
        start = 0
    else:
        target = dict(params=params, rest=rest, opt_state=opt_state)
        restored = checkpoint.restore(ckpt_dir, start, target, saved, meta, MODEL_FLAGS)
        params, rest, opt_state = restored["params"], restored["rest"], restored["opt_state"]
        # The checkpoint is in plain EP's expert order: back to the placements it was saved with.
        graphdef, params, rest, opt_state = balancer.restore(
            saved.meta, graphdef, params, rest, opt_state
        )
        if old_metrics is not None:
            history["train"] = [r for r in old_metrics["train"] if r["step"] < start]
            # The restored state is evaluated again at `start`: it must match the saved run.
            history["eval"] = [r for r in old_metrics["eval"] if r["step"] < start]
            for key in ("tokens_per_expert", "rank_load"):
                history[key] = old_metrics.get(key)
            old = old_metrics.get("rebalances") or []
            history["rebalances"] = [r for r in old if r["step"] < start]
        console.print(f"resumed from step {start} ({ckpt_dir})")
    committed = {"step": start if cfg.resume else None}

    def save(step, backend, params, rest, opt_state):
        """Commits the state after `step` steps, the metrics up to it first (process 0): a
        --resume from any committed step then finds its history (later records are dropped)."""
        committed["step"] = step
        if processes.is_main:
            metrics = metrics_of(cfg, history, backend, start, processes.count)
            write_outputs(cfg.output_dir, metrics, plot=False)
        params, opt_state = balancer.checkpoint_state(params, opt_state)
        state = dict(params=params, rest=rest, opt_state=opt_state)
        checkpoint.save(ckpt_dir, step, state, dict(meta, balance=balancer.to_meta()), processes)

    history, params, rest, opt_state, backend, feeder, stopped = loop(
        cfg=cfg,
        data=data,
        mesh=mesh,
        tx=tx,
        state=(graphdef, params, rest, opt_state),
        start=start,
        history=history,
        console=console,
        on_compile=on_compile,
        balancer=balancer,
        hook=hook,
        checkpoint=save,
        stop_due=lambda: preemption.due(processes),
    )
    if stopped is not None:  # SIGTERM: this step's checkpoint, then out
        if committed["step"] != stopped:
            save(stopped, backend, params, rest, opt_state)
        raise preemption.Stopped(
            f"stopped by SIGTERM after step {stopped} of {cfg.steps}: checkpoint/{stopped}/ "
            f"committed in {cfg.output_dir}; --resume continues from it"
        )
    if cfg.steps > start:  # otherwise nothing trained: the checkpoint at `start` stands
        save(cfg.steps, backend, params, rest, opt_state)
    # What each process read: its own rows of every batch (the same on one process: all).
    fed = processes.exchange("feeding", [feeder.rows.tolist(), feeder.windows_read])
    history["feeding"] = dict(
        rows=[rows for rows, _ in fed], windows_read=[count for _, count in fed]
    )
    result = metrics_of(cfg, history, backend, start, processes.count)
    if processes.is_main:
        written = write_outputs(cfg.output_dir, result, plot=True)
        if cfg.steps > start:
            written.append(f"checkpoint/{cfg.steps}/")
        console.print(f"wrote {', '.join(written)} to {cfg.output_dir}")
        console.print(f"eval loss: {result['final_eval_loss']:.4f}", highlight=False)
    return result


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]} (flags are --name=value)")
    logging.set_verbosity(logging.WARNING)
    run_job(
        NAME,
        flag_values(TrainConfig()),
        lambda processes: train(config_from_flags(), processes.console(), processes=processes),
    )


def command_line() -> None:
    """The command line (`python -m examples.train_moe`): defines the flags, then runs `main`
    under absl. Flags are defined only here, so that importing this module, e.g. from a test,
    leaves absl's global flag registry alone."""
    define_flags()
    startup.define_flags()
    app.run(main)
