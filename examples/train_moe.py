"""Main job: train a small MoE byte-level LM with optax, experts dispatched by jax_hybridep.

A decoder-only transformer (`lm_model.py`) whose FFNs are `jax_hybridep.nn.MoEBlock`s learns
next-byte prediction on the Python standard library's own source (`lm_data.py`; nothing is
downloaded). One `jax.jit`-compiled step does forward, backward (through dispatch/combine's VJPs)
and an AdamW update with warmup + cosine decay and global-norm clipping. Runs on all local GPUs,
or on 8 fake CPU devices when there are none; the mesh is given by --mesh ("node=2,local=4", the
CPU default: a two-level topology; "ep=8"; "data=2,ep=4"; ...), and every axis except "data" is
an EP level, slow -> fast.

    python examples/train_moe.py [--steps=500] [--mesh=data=2,ep=4] [--backend=xla] ...
    python examples/train_moe.py --resume --steps=1000  # continue from the saved checkpoint
    python examples/train_moe.py --redundant_slots=1 --rebalance_every=50  # balance expert load
    bash scripts/launch_local.sh 2 --mesh=node=2,local=4  # 2 processes (docs/multihost.md)

Writes to --output_dir: metrics.json (losses per step), train_moe.png (loss curves, expert and
per-rank load; `train_report.py`), checkpoint/<step>/ (orbax: model and optimizer state, and the
flags; committed atomically, see `train_checkpoint.py`; with --rebalance_every also the expert
placements, `rebalance_hook.py`). The last line printed is `eval loss: <value>`. Every flag is
checked before a model is built (`train_config.py`); a bad flag or an unusable --resume
checkpoint ends the run with one line naming it.

Several processes (hosts) run one job on `jax.distributed` (`train_processes.py`): each feeds only
its rows of every batch (`lm_data.ShardFeeder`), all write the checkpoint's shards, process 0
decides re-balancing and re-planning for all and alone writes metrics, plot and messages.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable

import jax
import numpy as np
import replan_hook
import train_checkpoint
import train_processes
from absl import app, logging
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from lm_data import VOCAB_SIZE, ByteData, ShardFeeder
from lm_model import DATA_AXIS, ModelConfig, MoETransformer, make_mesh
from rebalance_hook import Rebalancer, rank_loads
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from train_checkpoint import ResumeError
from train_config import FlagError, TrainConfig, check_config, flag_values
from train_flags import config_from_flags, define_flags
from train_processes import Processes, global_devices
from train_report import (
    imbalance,
    metrics_of,
    program_traffic,
    ran_backend,
    rebalance_line,
    write_outputs,
)
from train_step import build_steps, make_optimizer

from jax_hybridep import balance

# The flags that fix the shapes of the model and optimizer state (a checkpoint needs them equal;
# the domain flags fix the shapes of the SR and error-feedback state).
MODEL_FLAGS = (
    "d_model", "d_ff", "layers", "experts", "domains", "domain_compression", "domain_shared",
    "grad_compression",
)  # fmt: skip


def model_config(cfg: TrainConfig) -> ModelConfig:
    """The model `cfg` trains."""
    return ModelConfig(
        vocab_size=VOCAB_SIZE,
        d_model=cfg.d_model,
        d_ff=cfg.d_ff,
        layers=cfg.layers,
        heads=cfg.heads,
        experts=cfg.experts,
        top_k=cfg.top_k,
        capacity_factor=cfg.capacity_factor,
        backend=cfg.backend,
        migration=cfg.migration,
        wire_dtype=cfg.wire_dtype,
        # A placement (even without redundant slots) lets the rebalancer move experts.
        balance=(
            balance.BalanceConfig(cfg.redundant_slots)
            if cfg.redundant_slots or cfg.rebalance_every
            else None
        ),
        prefetch=cfg.prefetch,
    )


def mesh_spec(mesh) -> str:
    """The mesh as --mesh spells it ("node=2,local=4")."""
    return ",".join(f"{name}={size}" for name, size in mesh.shape.items())


def train(cfg: TrainConfig, console: Console | None = None, on_compile=None, hook=None,
          processes: Processes | None = None) -> dict:  # fmt: skip
    """Trains (or resumes) per `cfg`, writes metrics/plot/checkpoint, returns the metrics dict.

    Raises FlagError (a bad flag, before any model is built) or ResumeError (--resume cannot use
    the checkpoint), each naming what is wrong. `on_compile`, if given, is called with the
    compiled train step's HLO text (e.g. to read its collectives, `jax_hybridep.traffic`).
    `hook`: a `replan_hook.ReplanHook` (made from `cfg` when `replan_every` is set), asked after
    every step whether to switch domains. `processes`: this process's place in a job of
    several (None: `train_processes.current()`); every process calls `train`, and only process 0
    writes metrics and plot (every process writes its checkpoint shards).
    """
    processes = processes or train_processes.current()
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
    mesh, topology = make_mesh(cfg.mesh, devices)
    ckpt_dir = os.path.join(os.path.abspath(cfg.output_dir), "checkpoint")
    metrics_path = os.path.join(cfg.output_dir, "metrics.json")
    meta = dict(flag_values(cfg), processes=processes.count, mesh_shape=mesh_spec(mesh))
    if cfg.resume:  # what can be checked on disk is, before the model is built
        start = train_checkpoint.latest(ckpt_dir)
        saved = train_checkpoint.read_saved(ckpt_dir, start)
        defaults = flag_values(TrainConfig())
        train_checkpoint.check_resume_flags(ckpt_dir, start, saved.meta, meta, defaults)
        old_metrics = train_checkpoint.read_metrics(metrics_path)
    model_cfg = model_config(cfg)
    if hook is None and cfg.replan_every:
        hook = replan_hook.ReplanHook.from_config(cfg, model_cfg, mesh, topology)
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
        restored = train_checkpoint.restore(ckpt_dir, start, target, saved, meta, MODEL_FLAGS)
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
    if processes.is_main:
        os.makedirs(cfg.output_dir, exist_ok=True)

    def checkpoint(step, backend, params, rest, opt_state):
        """Commits the state after `step` steps, the metrics up to it first (process 0): a
        --resume from any committed step then finds its history (later records are dropped)."""
        if processes.is_main:
            metrics = metrics_of(cfg, history, backend, start, processes.count)
            write_outputs(cfg.output_dir, metrics, plot=False)
        params, opt_state = balancer.checkpoint_state(params, opt_state)
        state = dict(params=params, rest=rest, opt_state=opt_state)
        train_checkpoint.save(
            ckpt_dir, step, state, dict(meta, balance=balancer.to_meta()), processes
        )

    history, params, rest, opt_state, backend, feeder = _loop(
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
        checkpoint=checkpoint,
    )
    if cfg.steps > start:  # otherwise nothing trained: the checkpoint at `start` stands
        checkpoint(cfg.steps, backend, params, rest, opt_state)
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


def _loop(*, cfg, data, mesh, tx, state, start, history, console, on_compile, balancer, hook,
          checkpoint):  # fmt: skip
    """The training loop proper from `start`, on state = (graphdef, params, rest, opt_state):
    compile once (again when `balancer` changes a placement or `hook` switches domains), step,
    evaluate, checkpoint every `cfg.checkpoint_every` steps (`checkpoint`), report progress.
    Returns (history, params, rest, opt_state, backend, feeder)."""
    graphdef, params, rest, opt_state = state
    num_devices = mesh.devices.size
    # The batch is sharded over every mesh axis when it divides evenly, else replicated.
    batch_spec = P(tuple(mesh.axis_names)) if cfg.batch % num_devices == 0 else P()
    feeder = ShardFeeder(data, NamedSharding(mesh, batch_spec), cfg.batch, cfg.seq_len)
    eval_set = feeder.eval_batches(cfg.eval_batches)
    shardings = jax.tree.map(lambda a: a.sharding, (params, rest, opt_state))

    def compile_steps(graphdef):
        train_step, eval_step = build_steps(graphdef, tx, shardings, NamedSharding(mesh, P()))
        compiled = train_step.lower(params, rest, opt_state, inputs, targets).compile()
        history["compiles"] = history.get("compiles", 0) + 1
        return compiled, eval_step

    def evaluate(step):
        loss = float(np.mean([float(eval_step(params, rest, x, y)) for x, y in eval_set]))
        history["eval"].append(dict(step=step, loss=loss))
        return loss

    def rebalance(step):
        """Re-places the experts before `step` (a resumed run re-places at its first step as
        the uninterrupted run would); whether a placement changed."""
        nonlocal graphdef, params, rest, opt_state
        changed, graphdef, params, rest, opt_state = balancer.rebalance(
            step, graphdef, params, rest, opt_state
        )
        events = balancer.last_events
        history["rebalances"] += events
        console.print(rebalance_line(step, events), highlight=False)
        return changed

    inputs, targets = feeder.train_batch(cfg.seed, start)
    t0 = time.perf_counter()
    if 0 < start < cfg.steps and balancer.due(start):
        rebalance(start)
    history["compiles"] = 0  # of the train step in this process: 1 + placement changes
    compiled, eval_step = compile_steps(graphdef)
    backend = ran_backend(compiled.as_text())
    levels = [a for a in mesh.axis_names if a != DATA_AXIS]
    ep_size = math.prod(mesh.shape[a] for a in levels)
    history["program_traffic"] = program_traffic(compiled.as_text(), levels)
    if on_compile is not None:
        on_compile(compiled.as_text())
    count = jax.process_count()
    console.print(
        f"mesh {dict(mesh.shape)} on {num_devices} x {mesh.devices.flat[0].platform}"
        f"{f' in {count} processes' if count > 1 else ''}, "
        f"{cfg.layers} layers x {cfg.experts} experts (top-{cfg.top_k}), "
        f"{cfg.batch}x{cfg.seq_len} bytes/step; compiled in {time.perf_counter() - t0:.1f}s"
    )
    console.print(f"backend: {backend}")
    evaluate(start)
    tokens_per_expert = rank_load = None
    progress = Progress(
        TextColumn("step"),
        MofNCompleteColumn(),
        BarColumn(bar_width=20),
        TextColumn("{task.fields[stats]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=not (cfg.progress and console.is_terminal),
    )
    with progress:
        task = progress.add_task("train", total=cfg.steps, completed=start, stats="")
        for step in range(start, cfg.steps):
            if step > start:
                inputs, targets = feeder.train_batch(cfg.seed, step)
            if step > start and balancer.due(step) and rebalance(step):
                compiled, eval_step = compile_steps(graphdef)  # a new static placement
            t = time.perf_counter()
            params, rest, opt_state, m = compiled(params, rest, opt_state, inputs, targets)
            m = jax.device_get(m)
            seconds = time.perf_counter() - t
            tokens_per_expert = m["tokens_per_expert"]
            per_slot = np.asarray(m["tokens_per_slot"])
            rank_load = rank_loads(per_slot, per_slot.shape[-1] // ep_size)
            record = dict(
                step=step,
                loss=float(m["loss"]),
                ce=float(m["ce"]),
                aux=float(m["aux"]),
                grad_norm=float(m["grad_norm"]),
                dropped=int(m["dropped"]),
                imbalance=imbalance(tokens_per_expert),
                rank_imbalance=imbalance(rank_load),
                tokens_per_s=cfg.batch * cfg.seq_len / seconds,
                level_rows=np.asarray(m["level_rows"]).tolist(),
            )
            if not math.isfinite(record["loss"]):
                raise FloatingPointError(f"loss is {record['loss']} at step {step}")
            history["train"].append(record)
            history["tokens_per_expert"] = np.asarray(tokens_per_expert).tolist()
            history["rank_load"] = np.asarray(rank_load).tolist()
            new = hook.after_step(step + 1, m, params, rest) if hook is not None else None
            if new is not None:
                new_graphdef, rest = new
            if new is not None and new_graphdef is not None:
                graphdef = new_graphdef  # new domains: one more compile, the state carried over
                shardings = jax.tree.map(lambda a: a.sharding, (params, rest, opt_state))
                compiled, eval_step = compile_steps(graphdef)
                if on_compile is not None:
                    on_compile(compiled.as_text())
                progress.console.print(hook.describe(step + 1), highlight=False)
            stats = (
                f"loss {record['ce']:.3f} | {record['tokens_per_s']:,.0f} tok/s | "
                f"dropped {record['dropped']} | imbalance {record['imbalance']:.2f} "
                f"(ranks {record['rank_imbalance']:.2f})"
            )
            progress.update(task, completed=step + 1, stats=stats)
            if balancer.active:
                balancer.observe(tokens_per_expert)
            if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
                eval_loss = evaluate(step + 1)
                progress.console.print(
                    f"step {step + 1:5d}: {stats} | eval loss {eval_loss:.3f}", highlight=False
                )
            every = cfg.checkpoint_every
            if every and (step + 1) % every == 0 and step + 1 < cfg.steps:
                if hook is not None:
                    history["replans"] = hook.history
                checkpoint(step + 1, backend, params, rest, opt_state)
    if hook is not None:
        history["replans"] = hook.history
    return history, params, rest, opt_state, backend, feeder


def run_job(script: str, flag_names, body: Callable[[Processes], object]) -> None:
    """Runs `body(processes)` as this process of the job the process flags describe, once every
    process agrees on the flags `flag_names` (and the process flags) and the liveness watch
    runs; then waits for every process to finish.

    An expected error (a bad flag, an unusable --resume checkpoint, a non-finite loss, an I/O
    error) ends every process with one line naming it; any other as
    `train_processes.end_unexpected` says.
    """
    processes = Processes()
    try:
        processes = train_processes.start(train_processes.config_from_flags())
        names = [*flag_names, *train_processes.SHARED_FLAGS]
        # Before the watch: a flag error is then each process's own line, not a peer's verdict.
        processes.agree_on_flags(train_processes.command_line_values(names))
        processes.watch(script)
        body(processes)
        # Process 0 writes the outputs after the others' last step: they wait here (watched)
        # rather than in the runtime's shutdown barrier, whose timeout is short.
        processes.barrier("outputs written")
    except (FlagError, ResumeError, FloatingPointError, OSError) as err:
        train_processes.exit_with(processes, script, err)
    except BaseException as err:
        train_processes.end_unexpected(processes, script, err)
    processes.finish()


SCRIPT = "train_moe.py"


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]} (flags are --name=value)")
    logging.set_verbosity(logging.WARNING)
    run_job(
        SCRIPT,
        flag_values(TrainConfig()),
        lambda processes: train(config_from_flags(), processes.console(), processes=processes),
    )


if __name__ == "__main__":
    define_flags()
    train_processes.define_flags()
    app.run(main)
