"""The training loop of the main job (`loop`): compile, step, evaluate, re-balance or re-plan
when due, checkpoint every `--checkpoint_every` steps, report progress, stop after a step when
SIGTERM asks (`job_runtime/preemption.py`).
"""

from __future__ import annotations

import math
import time

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from examples.moe_lm.data import ShardFeeder
from examples.moe_lm.model import DATA_AXIS
from examples.train_moe.rebalance import rank_loads
from examples.train_moe.report import imbalance, program_traffic, ran_backend, rebalance_line
from examples.train_moe.step import build_steps


def loop(
    *,
    cfg,
    data,
    mesh,
    tx,
    state,
    start,
    history,
    console,
    on_compile,
    balancer,
    hook,
    checkpoint,
    stop_due,
):
    """The training loop proper from `start`, on state = (graphdef, params, rest, opt_state):
    compile once (again when `balancer` changes a placement or `hook` switches domains), step,
    evaluate, checkpoint every `cfg.checkpoint_every` steps (`checkpoint`), report progress;
    after each step but the last, stop when `stop_due()` (SIGTERM, `preemption.due`).
    Returns (history, params, rest, opt_state, backend, feeder, the step stopped after or
    None)."""
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
        f"{cfg.model.layers} layers x {cfg.model.experts} experts (top-{cfg.model.top_k}), "
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
    stopped = None
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
            if step + 1 < cfg.steps and stop_due():
                stopped = step + 1
                break
    if hook is not None:
        history["replans"] = hook.history
    return history, params, rest, opt_state, backend, feeder, stopped
