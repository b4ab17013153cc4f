"""Cross-datacenter MoE training: plan expert domains for a described cluster, then train.

The cluster: 2 datacenters x 2 nodes x 2 GPUs, played by 8 fake CPU devices as the mesh
(dc=2, node=2, local=2). Links are described by flags (WAN bandwidth shared by a DC's GPUs and
its latency, the inter-node and intra-node bandwidths). `jax_hybridep.xdc.plan` evaluates every
per-level domain size for the training example's model and picks the fastest; the example then
trains that model (`train_moe.py`) with the planned domains and with plain EP, and reports the
bytes each step sends across the DC level per rank — experts (all-gather and gradient
reduce-scatter, read off the compiled step) and tokens (run-time copies) — beside the planner's
prediction, and the losses.

    python examples/cross_dc.py [--steps=150] [--wan_gbps=10] [--domain_compression=10]
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np
from absl import app, flags, logging
from rich.console import Console
from rich.table import Table
from train_moe import TrainConfig, train

from jax_hybridep import xdc

MESH = (("dc", 2), ("node", 2), ("local", 2))

flags.DEFINE_integer("steps", 150, "training steps per run")
flags.DEFINE_integer("batch", 16, "sequences (of 128 bytes) per step: more tokens, more to move")
flags.DEFINE_float("wan_gbps", 10.0, "bandwidth between datacenters, shared by a DC's GPUs")
flags.DEFINE_float("wan_latency_ms", 5.0, "one-way latency between datacenters per message")
flags.DEFINE_float("node_gbps", 100.0, "per-GPU bandwidth between nodes of a datacenter")
flags.DEFINE_float("local_gbps", 3600.0, "per-GPU bandwidth inside a node (NVLink class)")
flags.DEFINE_float("domain_compression", None, "SR compression ratio of migrated experts")
flags.DEFINE_string("domains", None, "override the plan, e.g. 'dc=2' (default: planned)")
flags.DEFINE_string("backend", "auto", "dispatch/combine backend")
flags.DEFINE_string("output_dir", "/tmp/cross_dc", "where runs, metrics and summary go")
FLAGS = flags.FLAGS


def describe_cluster() -> xdc.cost.Cluster:
    """The flags as a cost-model cluster (bytes/s, seconds)."""
    wan = FLAGS.wan_gbps * 1e9 / 8
    links = (
        xdc.cost.Link(bandwidth=wan, alpha=FLAGS.wan_latency_ms * 1e-3, uplink=wan),
        xdc.cost.Link(bandwidth=FLAGS.node_gbps * 1e9 / 8, alpha=5e-6),
        xdc.cost.Link(bandwidth=FLAGS.local_gbps * 1e9 / 8, alpha=2e-6),
    )
    return xdc.cost.Cluster(tuple(s for _, s in MESH), links, tuple(n for n, _ in MESH))


def describe_workload(cfg: TrainConfig) -> xdc.Workload:
    """One training step of the example model, per rank (float32 activations and experts)."""
    ranks = int(np.prod([s for _, s in MESH]))
    d, f = cfg.d_model, cfg.d_ff
    return xdc.Workload(
        tokens=cfg.batch * cfg.seq_len // ranks,
        top_k=cfg.top_k,
        num_experts=cfg.experts,
        hidden=d,
        act_bytes=4,
        expert_matrices=((d, f), (d, f), (f, d)),
        value_bytes=4,
        ratio=cfg.domain_compression,
        layers=cfg.layers,
    )


def domains_spec(sizes) -> str | None:
    """(2, 1, 1) -> "dc=2"; plain EP -> None."""
    spec = ",".join(f"{n}={s}" for (n, _), s in zip(MESH, sizes, strict=True) if s > 1)
    return spec or None


def dc_bytes_per_step(result: dict, sizes, hidden: int) -> dict[str, float]:
    """Bytes one rank sends across the DC level per step, measured: experts from the compiled
    step's collectives, tokens from the run-time copy counts (4 exchanges of one dispatch)."""
    program = result["program_traffic"]["dc"]
    experts = program["all-gather"] + program["reduce-scatter"] + program["all-reduce"]
    token_levels = [n for (n, g), s in zip(MESH, sizes, strict=True) if g // s > 1]
    ranks = int(np.prod([s for _, s in MESH]))
    copies = 0.0
    if "dc" in token_levels:
        per_step = [r["level_rows"][token_levels.index("dc")] for r in result["train"]]
        copies = float(np.mean(per_step)) / ranks
    return dict(experts=experts, tokens=4 * copies * hidden * 4)


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    jax.config.update("jax_num_cpu_devices", 8)
    console = Console(soft_wrap=True)
    base = TrainConfig(
        steps=FLAGS.steps,
        batch=FLAGS.batch,
        mesh=",".join(f"{n}={s}" for n, s in MESH),
        backend=FLAGS.backend,
        domain_compression=FLAGS.domain_compression,
        eval_every=max(FLAGS.steps, 1),
        progress=False,
    )
    cluster, workload = describe_cluster(), describe_workload(base)
    plan = xdc.plan(cluster, workload)
    console.print(f"planner: every per-level domain size {cluster.names}, fastest first")
    console.print(plan.table(), highlight=False)
    planned = plan.domains
    if FLAGS.domains:
        given = dict(item.split("=") for item in FLAGS.domains.split(","))
        planned = tuple(int(given.get(n, 1)) for n, _ in MESH)
    console.print(
        f"planned domains {planned}: predicted {plan.speedup:.2f}x faster communication per "
        f"step than plain EP ({plan.plain_ep.comm_time * 1e3:.1f} ms -> "
        f"{plan.best.comm_time * 1e3:.1f} ms)"
    )

    runs = {"plain EP": (1, 1, 1), f"planned {planned}": planned}
    table = Table(title="bytes across the DC level per rank per step, and loss")
    for col in ("run", "experts B", "tokens B", "total B", "predicted B", "train loss", "eval"):
        table.add_column(col, justify="right")
    summary = dict(cluster=str(cluster), plan=plan.table(), runs={})
    for name, sizes in runs.items():
        cfg = dataclasses.replace(
            base,
            domains=domains_spec(sizes),
            output_dir=os.path.join(FLAGS.output_dir, domains_spec(sizes) or "plain_ep"),
        )
        console.rule(f"{name}: --domains={cfg.domains}")
        result = train(cfg, console)
        measured = dc_bytes_per_step(result, sizes, base.d_model)
        predicted = next(c for c in plan.candidates if c.domains == tuple(sizes))
        total = measured["experts"] + measured["tokens"]
        train_loss = float(np.mean([r["ce"] for r in result["train"][-10:]]))
        table.add_row(
            name,
            f"{measured['experts']:,.0f}",
            f"{measured['tokens']:,.0f}",
            f"{total:,.0f}",
            f"{predicted.bytes_per_level[0]:,.0f}",
            f"{train_loss:.3f}",
            f"{result['final_eval_loss']:.3f}",
        )
        summary["runs"][name] = dict(
            domains=sizes,
            dc_bytes=measured,
            predicted_dc_bytes=predicted.bytes_per_level[0],
            train_loss=train_loss,
            eval_loss=result["final_eval_loss"],
        )
    console.print(table)
    path = os.path.join(FLAGS.output_dir, "summary.json")
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)
    console.print(f"wrote {path}")


if __name__ == "__main__":
    app.run(main)
