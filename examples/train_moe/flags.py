"""The command line of the main job: one absl flag per `TrainConfig` field, and the
`TrainConfig` the parsed flags describe (`config.py` validates it). The cross-DC job
(`examples/cross_dc/`) shares the cross-DC flags (`define_migration_flags`,
`migration_from_flags`).

Flags are defined only when a script runs, so that importing these modules, e.g. from a test,
leaves absl's global flag registry alone.
"""

from __future__ import annotations

import dataclasses

from absl import flags

from examples.train_moe.config import (
    BACKENDS,
    DROPLESS,
    RESUMABLE_FLAGS,
    TrainConfig,
    migration_flags,
    parse_capacity_factor,
    parse_migration,
)
from jax_hybridep import xdc
from jax_hybridep.fp8 import WIRE_DTYPES
from jax_hybridep.xdc.migration import SHARED_VARIANTS


def define_flags() -> None:
    """The command-line flags, one per TrainConfig field (defined only when run as a script, so
    importing this module, e.g. from a test, leaves absl's global flag registry alone)."""
    d = TrainConfig()
    flags.DEFINE_integer("steps", d.steps, "total training steps (a resumed run continues to it)")
    flags.DEFINE_integer("batch", d.batch, "sequences per step")
    flags.DEFINE_integer("seq_len", d.seq_len, "bytes per sequence")
    flags.DEFINE_integer("d_model", d.d_model, "model width")
    flags.DEFINE_integer("d_ff", d.d_ff, "expert FFN hidden width")
    flags.DEFINE_integer("layers", d.layers, "transformer layers")
    flags.DEFINE_integer("heads", d.heads, "attention heads")
    flags.DEFINE_integer("experts", d.experts, "routed experts per layer")
    flags.DEFINE_integer("top_k", d.top_k, "experts per token")
    flags.DEFINE_string(
        "mesh",
        None,
        "mesh axis sizes, e.g. 'node=2,local=4', 'ep=8' or 'data=2,ep=4' "
        "(default: node=2,local=n/2 on CPU, ep=all on GPUs)",
    )
    flags.DEFINE_enum("backend", d.backend, list(BACKENDS), "dispatch/combine backend")
    define_migration_flags(
        d.migration, "cross-DC expert domain sizes per EP level, e.g. 'dc=2' (unset: plain EP)"
    )
    flags.DEFINE_bool("prefetch", False, "gather every layer's experts at step start")
    flags.DEFINE_integer("replan_every", 0, "re-plan the domains every N steps (needs --links)")
    flags.DEFINE_string("links", None, "EP level links to plan for, e.g. dc=10:5:shared,...")
    flags.DEFINE_string("link_schedule", None, "link bandwidth changes by step, e.g. '200:dc=1'")
    flags.DEFINE_float("memory_limit_mb", 0.0, "per-device memory limit of re-plans (0: none)")
    flags.DEFINE_string(
        "capacity_factor",
        DROPLESS,
        f"per-expert capacity factor, a number > 0; '{DROPLESS}' (the default): dropless",
    )
    flags.DEFINE_enum(
        "wire_dtype",
        None,
        list(WIRE_DTYPES),
        "FP8 dispatch (one scale per 128 elements); unset: the model's dtype",
    )
    flags.DEFINE_integer(
        "redundant_slots", d.redundant_slots, "expert slots per EP rank for copies of hot experts"
    )
    flags.DEFINE_integer(
        "rebalance_every",
        d.rebalance_every,
        "re-place the experts every this many steps from the measured load (0: never)",
    )
    flags.DEFINE_bool(
        "charge_sync",
        d.charge_sync,
        "the balancer charges each replica's sync bytes against the rows it saves",
    )
    flags.DEFINE_float("lr", d.lr, "peak learning rate")
    flags.DEFINE_integer(
        "schedule_steps",
        d.schedule_steps,
        "the step the learning-rate decay ends at (0: --steps); set it to the final step count "
        "when a run will be resumed to more steps",
    )
    flags.DEFINE_integer("seed", d.seed, "random seed (init and data order)")
    flags.DEFINE_string("output_dir", d.output_dir, "metrics, plot and checkpoint go here")
    flags.DEFINE_integer("eval_every", d.eval_every, "evaluate every this many steps")
    flags.DEFINE_integer(
        "checkpoint_every",
        d.checkpoint_every,
        "also commit a checkpoint and metrics.json every this many steps (0: only at the end)",
    )
    flags.DEFINE_bool(
        "resume",
        False,
        "restore the checkpoint in --output_dir and continue; every flag must equal the "
        f"checkpoint's except {', '.join('--' + n for n in RESUMABLE_FLAGS)}, "
        "--coordinator_address, --process_id and --heartbeat_timeout_s",
    )


def define_migration_flags(default: xdc.Migration, domains_help: str) -> None:
    """The cross-DC flags `parse_migration` reads: --domains (unset by default) and how experts
    travel, with `default`'s values."""
    flags.DEFINE_string("domains", None, domains_help)
    flags.DEFINE_float(
        "domain_compression", default.compression, "SR compression ratio (> 1) of migrated experts"
    )
    flags.DEFINE_enum(
        "domain_shared", default.shared, list(SHARED_VARIANTS), "SR shared expert (reference)"
    )
    flags.DEFINE_integer(
        "domain_sync_every", default.sync_every, "steps between SR shared-expert refreshes"
    )
    flags.DEFINE_float(
        "grad_compression",
        default.grad_compression,
        "top-k ratio (> 1) of replica gradients, error feedback (lossy)",
    )


def migration_from_flags() -> xdc.Migration:
    """The parsed cross-DC flags as one `xdc.Migration` (FlagError for a bad value)."""
    return parse_migration(**{n: flags.FLAGS[n].value for n in migration_flags(xdc.Migration())})


def config_from_flags() -> TrainConfig:
    """The TrainConfig the parsed command-line flags describe (FlagError for a bad value)."""
    values = {
        f.name: flags.FLAGS[f.name].value
        for f in dataclasses.fields(TrainConfig)
        if f.name in flags.FLAGS
    }
    values["capacity_factor"] = parse_capacity_factor(values["capacity_factor"])
    return TrainConfig(**values, migration=migration_from_flags())
