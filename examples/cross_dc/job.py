"""The cross-DC job (its command: `python -m examples.cross_dc`, `__main__.py`, whose docstring is
its --help): the main job's model and `train` (`examples/train_moe/`) on a described cluster of
2 DCs x 2 nodes x 2 GPUs, once per run it compares, with the planned expert domains and with
plain EP.

Where it differs from the main job: its flags, their checks and the cluster they describe
(`settings.py`); its three modes, the plan (`run_plan`), the SR variants side by side
(`run_sr_table`) or one re-planned run with a skew of the routing (`run_replanning`,
`SkewingHook`); the bytes across the DC level it reports beside the cost model's prediction
(`crossing.py`); its summary.json. The job around it (processes, SIGTERM, one-line errors)
is the one both jobs run in (`examples/job_runtime/`).
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
from absl import app, logging
from flax import nnx
from rich.console import Console
from rich.table import Table

from examples.cross_dc.crossing import first_step, measure, predict, program_bytes
from examples.cross_dc.settings import (
    MESH,
    RANKS,
    Settings,
    define_flags,
    describe_cluster,
    links_spec,
)
from examples.job_runtime import flag_fields, startup
from examples.job_runtime.flag_fields import replace
from examples.job_runtime.processes import Processes, exit_with
from examples.job_runtime.run_job import run_job
from examples.job_runtime.startup import global_devices
from examples.moe_lm.model import ModelConfig, describe_workload, make_mesh
from examples.train_moe.config import TrainConfig, migration_flags
from examples.train_moe.flags import migration_from_flags
from examples.train_moe.job import train
from examples.train_moe.replan import ReplanHook
from jax_hybridep import xdc

NAME = "cross_dc"  # the command's and the package's name; it starts the lines the job ends with

SR_TABLE = (  # name, (SR ratio, shared expert, gradient compression) or None (full experts)
    ("full experts", None),
    ("SR, persistent shared expert", ("c", "persistent", None)),
    ("SR, per-step domain mean", ("c", "mean", None)),
    ("SR, no shared expert", ("c", "none", None)),
    ("SR persistent + gradient compression", ("c", "persistent", "g")),
)


def over_domains(migration: xdc.Migration, sizes) -> xdc.Migration:
    """`migration` over per-level `sizes` (2, 1, 1); plain EP (every size 1) compresses nothing."""
    named = tuple((n, size) for (n, _), size in zip(MESH, sizes, strict=True) if size > 1)
    if not named:
        migration = dataclasses.replace(migration, compression=None, grad_compression=None)
    return migration.with_domains(named)


def workload_of(cfg: TrainConfig, dense: int) -> xdc.Workload:
    """The planner's view of one training step of `cfg`."""
    return describe_workload(cfg.built_model, cfg.batch * cfg.seq_len // RANKS, dense)


def run_one(
    s: Settings,
    base: TrainConfig,
    sizes,
    migration: xdc.Migration,
    routing,
    dense,
    console,
    name: str | None = None,
) -> dict:
    """Trains `migration` over domains of `sizes` and returns its measured and predicted DC
    bytes and losses."""
    migration = over_domains(migration, sizes)
    flags_ = migration_flags(migration)
    cfg = replace(
        base,
        migration=migration,
        output_dir=os.path.join(s.output_dir, name or flags_["domains"] or "plain_ep"),
    )
    console.rule(f"{name or ''} {flags_}")
    hlo = []
    result = train(cfg, console, on_compile=hlo.append, job=NAME)
    workload = workload_of(cfg, dense)
    token_levels = [n for (n, g), size in zip(MESH, sizes, strict=True) if g // size > 1]
    return dict(
        domains=list(sizes),
        migration=flags_,
        compression=migration.compression,
        measured=measure(
            hlo[0], result, token_levels, base.model.d_model, RANKS, workload.migration.sync_every
        ),
        predicted=predict(describe_cluster(s), workload, tuple(sizes), routing),
        train_loss=float(np.mean([r["ce"] for r in result["train"][-10:]])),
        eval_loss=result["final_eval_loss"],
        train=result["train"],
    )


def base_config(s: Settings) -> TrainConfig:
    """The training example's model and run, on the example's mesh, without domains."""
    return TrainConfig(
        steps=s.steps,
        batch=s.batch,
        model=ModelConfig(backend=s.backend, prefetch=s.prefetch),
        mesh=",".join(f"{n}={g}" for n, g in MESH),
        eval_every=s.steps,
        progress=False,
    )


def _bytes_table(title: str, runs: dict) -> Table:
    table = Table(title=title)
    for col in (
        "run",
        "experts B",
        "all-reduce B",
        "tokens B",
        "total B",
        "predicted B",
        "of which dense",
        "train loss",
        "eval",
    ):
        table.add_column(col, justify="right")
    for name, r in runs.items():
        m, p = r["measured"], r["predicted"]
        table.add_row(
            name,
            f"{m['experts']:,.0f}",
            f"{m['all_reduce']:,.0f}",
            f"{m['tokens']:,.0f}",
            f"{m['total']:,.0f}",
            f"{p['total']:,.0f}",
            f"{p['dense']:,.0f}",
            f"{r['train_loss']:.3f}",
            f"{r['eval_loss']:.3f}",
        )
    return table


def run(s: Settings, console: Console, first=None) -> dict:
    """Runs the mode the flags ask for, prints its tables; returns the summary. `first` is
    `first_step(base_config(s))` if already computed."""
    s.check()
    base = base_config(s)
    dense, routing = first or first_step(base)
    if s.replan_every:
        summary = run_replanning(s, base, dense, console)
    elif s.sr_table:
        summary = run_sr_table(s, base, dense, routing, console)
    else:
        summary = run_plan(s, base, dense, routing, console)
    if startup.current().is_main:
        path = os.path.join(s.output_dir, "summary.json")
        os.makedirs(s.output_dir, exist_ok=True)
        with open(path, "w") as f:
            json.dump(summary, f, indent=1)
        console.print(f"wrote {path}")
    return summary


def run_plan(s: Settings, base, dense, routing, console) -> dict:
    """Plans for the described cluster, trains plain EP and the plan (or `--domains`)."""
    cluster = describe_cluster(s)
    migration = s.migration
    plan = xdc.plan(cluster, workload_of(replace(base, migration=migration), dense))
    console.print(f"planner: every per-level domain size {cluster.names}, fastest first")
    console.print(plan.table(), highlight=False)
    planned = s.domain_sizes() or plan.domains
    chosen = next(c for c in plan.candidates if c.domains == planned)
    console.print(
        f"domains {planned}: predicted {plan.plain_ep.comm_time / chosen.comm_time:.2f}x less "
        f"communication per step than plain EP ({plan.plain_ep.comm_time * 1e3:.1f} ms -> "
        f"{chosen.comm_time * 1e3:.1f} ms; uniform routing)"
    )
    runs = {"plain EP": (1, 1, 1)}
    if planned != (1, 1, 1):
        runs[f"{'--domains' if s.migration.domains else 'planned'} {planned}"] = planned
    summary = dict(cluster=str(cluster), plan=plan.table(), dense_bytes=dense, runs={})
    for name, sizes in runs.items():
        r = run_one(s, base, sizes, migration, routing, dense, console)
        label = name + (f", SR {r['compression']:g}" if r["compression"] else "")
        summary["runs"][label] = r
    console.print(
        _bytes_table("bytes across the DC level per rank per step, and loss", summary["runs"])
    )
    for name, r in summary["runs"].items():
        console.print(
            f"{name}: tokens over all steps {r['measured']['tokens_mean']:,.0f} B/step on average; "
            f"scalar losses and counters {r['measured']['metrics']:,.0f} B (not modelled)"
        )
    return summary


def run_sr_table(s: Settings, base, dense, routing, console) -> dict:
    """Plain EP, full-expert domains and the SR variants at `--domains` (default dc=2)."""
    sizes = s.domain_sizes() or (2, 1, 1)
    ratio, grad = s.migration.compression or 10.0, s.migration.grad_compression or 10.0
    summary = dict(
        domains=list(sizes),
        compression=ratio,
        grad_compression=grad,
        sync_every=s.migration.sync_every,
        dense_bytes=dense,
        runs={},
    )
    plain = dataclasses.replace(s.migration, compression=None, grad_compression=None)
    summary["runs"]["plain EP"] = run_one(
        s, base, (1, 1, 1), plain, routing, dense, console, "plain_ep"
    )
    for i, (name, sr) in enumerate(SR_TABLE):
        m = plain
        if sr is not None:
            _, shared, g = sr
            m = dataclasses.replace(
                plain, compression=ratio, shared=shared, grad_compression=grad if g else None
            )
        summary["runs"][f"{name} {sizes}"] = run_one(
            s, base, sizes, m, routing, dense, console, f"sr_table_{i}"
        )
    console.print(
        _bytes_table(
            f"bytes across the DC level per rank per step and loss after {s.steps} steps (SR "
            f"{ratio:g}x, gradients {grad:g}x, persistent refresh every {s.migration.sync_every})",
            summary["runs"],
        )
    )
    return summary


class SkewingHook(ReplanHook):
    """The re-planning hook, also skewing the routing at `skew_at` (a router bias of +1 on
    experts 0 and 1 in every layer: softmax scores lie in (0, 1), so every token picks them)."""

    skew_at = 0

    def after_step(self, step, metrics, params, rest):
        out = super().after_step(step, metrics, params, rest)
        if step != self.skew_at:
            return out
        graphdef, rest = out if out is not None else (None, rest)

        def skew(path, var):
            if path[-2:] == ("router", "bias"):
                return var.replace(var[...].at[:2].add(1.0))
            return var

        return graphdef, nnx.map_state(skew, rest)


def run_replanning(s: Settings, base, dense, console) -> dict:
    """One run re-planned every `--replan_every` steps (`xdc.Replanner`)."""
    cfg = replace(
        base,
        migration=s.migration,
        replan_every=s.replan_every,
        links=links_spec(s),
        link_schedule=s.link_schedule,
        output_dir=os.path.join(s.output_dir, "replanning"),
    )
    mesh, topology = make_mesh(cfg.mesh, global_devices())
    schedule = xdc.LinkSchedule.parse(s.link_schedule, [n for n, _ in MESH])
    replanner = xdc.Replanner(
        describe_cluster(s),
        workload_of(cfg, dense),
        every=s.replan_every,
        schedule=schedule,
        min_gain=s.min_gain,
        layer_domains=s.domain_sizes(),
    )
    hook = SkewingHook(replanner, cfg.built_model, mesh, topology)
    hook.skew_at = s.skew_at
    hlo = []
    result = train(cfg, console, on_compile=hlo.append, hook=hook, job=NAME)
    programs = [program_bytes(text, cfg.model.migration.sync_every) for text in hlo]
    table = Table(title="re-plans (predicted seconds per step under that step's links and routing)")
    for col in (
        "step",
        "WAN Gbps",
        "skew",
        "domains per layer",
        "changed",
        "current ms",
        "chosen ms",
    ):
        table.add_column(col, justify="right")
    for h in replanner.history:
        table.add_row(
            str(h["step"]),
            f"{h['gbps']['dc']:g}",
            f"{h['skew']:.2f}",
            str(h["layer_domains"]),
            "yes" if h["changed"] else "",
            f"{h['current_s'] * 1e3:.1f}",
            f"{h['chosen_s'] * 1e3:.1f}",
        )
    console.print(table)
    changes = sum(h["changed"] for h in replanner.history)
    console.print(f"compiles: {len(hlo)} (1 + {changes} plan changes)")
    for i, p in enumerate(programs):
        console.print(
            f"compiled step {i + 1}: {p['experts']:,.0f} B of experts and {p['all_reduce']:,.0f} B "
            "of all-reduce across the DC level per rank and step"
        )
    console.print(f"eval loss {result['final_eval_loss']:.3f}")
    return dict(
        history=replanner.history,
        compiles=len(hlo),
        programs=programs,
        eval_loss=result["final_eval_loss"],
        train=result["train"],
    )


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    values = flag_fields.parsed_values(Settings(), skip=("migration",))
    try:  # before jax starts: a bad flag costs nothing
        settings = Settings(**values, migration=migration_from_flags())
        settings.check()
    except ValueError as err:  # FlagError included
        exit_with(Processes(), NAME, err)

    def body(processes):
        console = processes.console()
        console.width = max(console.width, 132)
        run(settings, console)

    run_job(NAME, [*values, *migration_flags(xdc.Migration())], body)


def command_line() -> None:
    """The command line (`python -m examples.cross_dc`): defines the flags, then runs `main`
    under absl."""
    define_flags()
    startup.define_flags()
    app.run(main)
