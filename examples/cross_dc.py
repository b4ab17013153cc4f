"""Cross-datacenter MoE training: plan expert domains for a described cluster, then train.

The cluster: 2 datacenters x 2 nodes x 2 GPUs, played by 8 fake CPU devices as the mesh
(dc=2, node=2, local=2). Links are described by flags (WAN bandwidth shared by a DC's GPUs and
its latency, the inter-node and intra-node bandwidths). `jax_hybridep.xdc.plan` evaluates every
per-level domain size for the training example's model and picks the fastest; the example then
trains that model (`train_moe.py`) with the planned domains (SR-compressed with
`--domain_compression`) and with plain EP, and reports, per rank and step, the bytes that cross
the DC level beside the model's prediction for the same run:

* experts: the all-gather and the gradient reduce-scatter, read off the compiled step;
* all-reduce: the shared expert's sync (SR compression) and the dense data-parallel gradients,
  read off the compiled step (the scalar losses and integer counters, a few hundred bytes, are
  reported apart and not modelled);
* tokens: the first step's run-time copy counts, predicted from that step's routing (replayed
  from the initial model and batch, so the prediction uses the run's routing, not a uniform one).

    python examples/cross_dc.py [--steps=150] [--wan_gbps=10] [--domain_compression=10]
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from lm_data import ByteData
from lm_model import MoETransformer, make_mesh
from rich.console import Console
from rich.table import Table
from train_moe import TrainConfig, model_config, train

from jax_hybridep import nn as hnn
from jax_hybridep import traffic, xdc
from jax_hybridep.nn.router import route

MESH = (("dc", 2), ("node", 2), ("local", 2))
RANKS = math.prod(s for _, s in MESH)
ACT_BYTES = 4  # the example model's float32 activations and parameters


@dataclasses.dataclass(frozen=True)
class Settings:
    """The example's flags, as one value tests can build directly."""

    steps: int = 150
    batch: int = 16
    wan_gbps: float = 10.0
    wan_latency_ms: float = 5.0
    node_gbps: float = 100.0
    local_gbps: float = 3600.0
    domain_compression: float | None = None
    domains: str | None = None
    backend: str = "auto"
    output_dir: str = "/tmp/cross_dc"

    def check(self) -> None:
        """ValueError naming the flag and its value, before any model is built."""

        def bad(flag, why):
            raise ValueError(f"--{flag}={getattr(self, flag)!r}: {why}")

        def number(value) -> bool:
            return isinstance(value, int | float) and not isinstance(value, bool)

        if not isinstance(self.steps, int) or self.steps < 1:
            bad("steps", "must be an integer >= 1")
        if not isinstance(self.batch, int) or self.batch < 1 or self.batch % RANKS:
            bad("batch", f"must be a positive multiple of the {RANKS} devices")
        for flag in ("wan_gbps", "node_gbps", "local_gbps"):
            value = getattr(self, flag)
            if not number(value) or not 0 < value < math.inf:
                bad(flag, "must be a finite bandwidth > 0")
        if not number(self.wan_latency_ms) or not 0 <= self.wan_latency_ms < math.inf:
            bad("wan_latency_ms", "must be a finite latency >= 0")
        c = self.domain_compression
        if c is not None and (not number(c) or not 1 < c < math.inf):
            bad("domain_compression", "must be > 1 (full bytes / bytes sent), or unset")
        if self.backend not in ("auto", "xla", "ffi"):
            bad("backend", "must be one of auto, xla, ffi")
        if not self.output_dir:
            bad("output_dir", "must name a directory")
        if self.domains is not None:
            self.domain_sizes()

    def domain_sizes(self) -> tuple[int, ...] | None:
        """`--domains` as one size per mesh level (None: use the plan)."""
        if self.domains is None:
            return None
        sizes = dict(MESH)
        given = {}
        for item in self.domains.split(","):
            name, _, value = item.partition("=")
            name = name.strip()
            if name not in sizes or not value.strip().isdigit():
                raise ValueError(
                    f"--domains={self.domains!r}: {item!r} is not LEVEL=SIZE with LEVEL one of "
                    f"{', '.join(sizes)}"
                )
            size = int(value)
            if size < 1 or sizes[name] % size:
                raise ValueError(
                    f"--domains={self.domains!r}: {name}={size} must divide the level's "
                    f"{sizes[name]} ranks"
                )
            given[name] = size
        return tuple(given.get(n, 1) for n, _ in MESH)


def describe_cluster(s: Settings) -> xdc.cost.Cluster:
    """The flags as a cost-model cluster (bytes/s, seconds)."""
    wan = s.wan_gbps * 1e9 / 8
    links = (
        xdc.cost.Link(bandwidth=wan, alpha=s.wan_latency_ms * 1e-3, uplink=wan),
        xdc.cost.Link(bandwidth=s.node_gbps * 1e9 / 8, alpha=5e-6),
        xdc.cost.Link(bandwidth=s.local_gbps * 1e9 / 8, alpha=2e-6),
    )
    return xdc.cost.Cluster(tuple(g for _, g in MESH), links, tuple(n for n, _ in MESH))


def describe_workload(
    cfg: TrainConfig, compression: float | None, dense_bytes: int
) -> xdc.Workload:
    """One training step of the example model, per rank (float32 activations and experts)."""
    d, f = cfg.d_model, cfg.d_ff
    return xdc.Workload(
        tokens=cfg.batch * cfg.seq_len // RANKS,
        top_k=cfg.top_k,
        num_experts=cfg.experts,
        hidden=d,
        act_bytes=ACT_BYTES,
        expert_matrices=((d, f), (d, f), (f, d)),
        value_bytes=ACT_BYTES,
        compression=compression,
        layers=cfg.layers,
        dense_bytes=dense_bytes,
    )


def domains_spec(sizes) -> str | None:
    """(2, 1, 1) -> "dc=2"; plain EP -> None."""
    spec = ",".join(f"{n}={s}" for (n, _), s in zip(MESH, sizes, strict=True) if s > 1)
    return spec or None


def first_step(cfg: TrainConfig) -> tuple[int, list[np.ndarray]]:
    """(dense parameter bytes, per MoE layer the [ranks, T, K] routing of the first step).

    Replays the first training step's forward pass from the same initial model and batch as
    `train(cfg)` and routes each MoE block's input as the block does. Values with domains equal
    plain EP's, so every run of the example routes its first step alike."""
    mesh, topology = make_mesh(cfg.mesh, jax.devices())
    model = MoETransformer(model_config(cfg), mesh, topology, rngs=nnx.Rngs(cfg.seed))
    params = nnx.state(model, nnx.Param)
    specs = jax.tree.leaves(nnx.get_partition_spec(params), is_leaf=lambda x: isinstance(x, P))
    # Replicated parameters (no mesh axis named) are the ones data parallelism all-reduces.
    dense = sum(
        leaf.size * leaf.dtype.itemsize
        for leaf, spec in zip(jax.tree.leaves(params), specs, strict=True)
        if all(axis is None for axis in spec)
    )
    inputs, _ = ByteData.load().train_batch(cfg.seed, 0, cfg.batch, cfg.seq_len)
    inputs = jax.device_put(inputs, NamedSharding(mesh, P(tuple(mesh.axis_names))))
    graphdef, state = nnx.split(model)
    call = hnn.MoEBlock.__call__

    @jax.jit
    def routing(state, inputs):
        seen = []

        def recording(block, x):  # routes the block's input as the block does
            tokens = x.reshape(-1, x.shape[-1]).astype(block.dtype).astype(jnp.float32)
            logits = jnp.dot(tokens, block.router.gate[...].astype(jnp.float32))
            seen.append(route(logits, block.router.bias[...], block.router.config).topk_idx)
            return call(block, x)

        hnn.MoEBlock.__call__ = recording
        try:
            nnx.merge(graphdef, state)(inputs)
        finally:
            hnn.MoEBlock.__call__ = call
        return seen

    per_layer = [np.asarray(idx) for idx in routing(state, inputs)]
    return dense, [idx.reshape(RANKS, -1, idx.shape[-1]) for idx in per_layer]


def _parameter_array(kind: str, shape) -> bool:
    """Float arrays of rank >= 1: gradients and expert weights, not the scalar losses."""
    return kind.startswith(("f", "bf")) and len(shape) >= 1


def measure(hlo_text: str, result: dict, sizes, hidden: int) -> dict[str, float]:
    """Bytes one rank receives across the DC level per step, measured (see the module doc)."""
    axes = {"dc", "dc" + xdc.domains.INNER_SUFFIX}
    every = traffic.crossing_bytes(hlo_text, axes)
    params = traffic.crossing_bytes(hlo_text, axes, operands=_parameter_array)
    token_levels = [n for (n, g), s in zip(MESH, sizes, strict=True) if g // s > 1]
    tokens = mean = 0.0
    if "dc" in token_levels:
        level = token_levels.index("dc")
        rows = [r["level_rows"][level] for r in result["train"]]
        per_copy = 4 * hidden * ACT_BYTES / RANKS  # 4 exchanges a step, mean over ranks
        tokens, mean = rows[0] * per_copy, float(np.mean(rows)) * per_copy
    experts = every["all-gather"] + every["reduce-scatter"]
    return dict(
        experts=experts,
        all_reduce=params["all-reduce"],
        tokens=tokens,
        total=experts + params["all-reduce"] + tokens,
        metrics=every["all-reduce"] - params["all-reduce"],
        tokens_mean=mean,
    )


def predict(cluster, workload: xdc.Workload, sizes, routing: list[np.ndarray]) -> dict:
    """The same bytes from `xdc.volumes` fed each layer's first-step routing."""
    layers = [
        workload.volumes(cluster.level_sizes, sizes, idx).levels[0] for idx in routing
    ]  # one layer's volumes per routing
    v = layers[0]
    exchanges = 4
    experts = len(layers) * (v.gather_bytes + v.reduce_scatter_bytes)
    all_reduce = len(layers) * v.shared_sync_bytes + v.dense_sync_bytes
    tokens = sum(exchanges * x.token_bytes for x in layers)
    return dict(
        experts=experts,
        all_reduce=all_reduce,
        dense=v.dense_sync_bytes,
        tokens=tokens,
        total=experts + all_reduce + tokens,
    )


def run_one(s: Settings, base: TrainConfig, sizes, compression, routing, dense, console) -> dict:
    """Trains one configuration and returns its measured and predicted DC bytes and losses."""
    cfg = dataclasses.replace(
        base,
        domains=domains_spec(sizes),
        domain_compression=compression if domains_spec(sizes) else None,
        output_dir=os.path.join(s.output_dir, domains_spec(sizes) or "plain_ep"),
    )
    console.rule(f"--domains={cfg.domains} --domain_compression={cfg.domain_compression}")
    hlo = []
    result = train(cfg, console, on_compile=hlo.append)
    cluster = describe_cluster(s)
    workload = describe_workload(base, cfg.domain_compression, dense)
    return dict(
        domains=list(sizes),
        compression=cfg.domain_compression,
        measured=measure(hlo[0], result, sizes, base.d_model),
        predicted=predict(cluster, workload, tuple(sizes), routing),
        train_loss=float(np.mean([r["ce"] for r in result["train"][-10:]])),
        eval_loss=result["final_eval_loss"],
    )


def base_config(s: Settings) -> TrainConfig:
    """The training example's model and run, on the example's mesh, without domains."""
    return TrainConfig(
        steps=s.steps,
        batch=s.batch,
        mesh=",".join(f"{n}={g}" for n, g in MESH),
        backend=s.backend,
        eval_every=s.steps,
        progress=False,
    )


def run(s: Settings, console: Console, first=None) -> dict:
    """Plans, trains plain EP and the plan, prints the table; returns the summary. `first` is
    `first_step(base_config(s))` if already computed."""
    s.check()
    base = base_config(s)
    dense, routing = first or first_step(base)
    cluster = describe_cluster(s)
    plan = xdc.plan(cluster, describe_workload(base, s.domain_compression, dense))
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
        runs[f"{'planned' if s.domains is None else '--domains'} {planned}"] = planned
    elif s.domain_compression:
        console.print(
            "the plan is plain EP, so there is nothing to compress: --domains=dc=2 runs domains "
            "with SR compression"
        )
    summary = dict(cluster=str(cluster), plan=plan.table(), dense_bytes=dense, runs={})
    for name, sizes in runs.items():
        summary["runs"][name] = run_one(
            s, base, sizes, s.domain_compression, routing, dense, console
        )
    table = Table(title="bytes across the DC level per rank per step (first step), and loss")
    for col in ("run", "experts B", "all-reduce B", "tokens B", "total B", "predicted B",
                "of which dense", "train loss", "eval"):  # fmt: skip
        table.add_column(col, justify="right")
    for name, r in summary["runs"].items():
        m, p = r["measured"], r["predicted"]
        label = name + (f", SR {r['compression']:g}" if r["compression"] else "")
        table.add_row(
            label, f"{m['experts']:,.0f}", f"{m['all_reduce']:,.0f}", f"{m['tokens']:,.0f}",
            f"{m['total']:,.0f}", f"{p['total']:,.0f}", f"{p['dense']:,.0f}",
            f"{r['train_loss']:.3f}", f"{r['eval_loss']:.3f}",
        )  # fmt: skip
    console.print(table)
    for name, r in summary["runs"].items():
        console.print(
            f"{name}: tokens over all steps {r['measured']['tokens_mean']:,.0f} B/step on average; "
            f"scalar losses and counters {r['measured']['metrics']:,.0f} B (not modelled)"
        )
    path = os.path.join(s.output_dir, "summary.json")
    os.makedirs(s.output_dir, exist_ok=True)
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)
    console.print(f"wrote {path}")
    return summary


def define_flags() -> None:
    """One flag per `Settings` field (only when run as a script)."""
    d = Settings()
    flags.DEFINE_integer("steps", d.steps, "training steps per run")
    flags.DEFINE_integer("batch", d.batch, "sequences (of 128 bytes) per step, a multiple of 8")
    flags.DEFINE_float("wan_gbps", d.wan_gbps, "bandwidth between datacenters, shared by a DC")
    flags.DEFINE_float("wan_latency_ms", d.wan_latency_ms, "one-way WAN latency per message")
    flags.DEFINE_float("node_gbps", d.node_gbps, "per-GPU bandwidth between nodes of a DC")
    flags.DEFINE_float("local_gbps", d.local_gbps, "per-GPU bandwidth inside a node (NVLink)")
    flags.DEFINE_float("domain_compression", None, "SR compression of migrated experts (> 1)")
    flags.DEFINE_string("domains", None, "override the plan, e.g. 'dc=2' (default: planned)")
    flags.DEFINE_string("backend", d.backend, "dispatch/combine backend: auto, xla or ffi")
    flags.DEFINE_string("output_dir", d.output_dir, "where runs, metrics and summary go")


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    names = [f.name for f in dataclasses.fields(Settings)]
    settings = Settings(**{n: flags.FLAGS[n].value for n in names})
    try:
        settings.check()  # before jax starts: a bad flag costs nothing
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    jax.config.update("jax_num_cpu_devices", RANKS)
    run(settings, Console(soft_wrap=True, width=max(Console().width, 132)))


if __name__ == "__main__":
    define_flags()
    app.run(main)
