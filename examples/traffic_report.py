"""Inter-node traffic of hierarchical vs flat dispatch under DeepSeek-V3 routing.

DeepSeek-V3's router (256 experts, top-8, experts grouped by node, each token limited to 4 of 8
nodes) on a (node=8, local=8) mesh of 64 fake CPU devices (8 GPUs a node, as DeepSeek-V3 ran),
with scaled-down tokens. Counts, from the ops' own run-time stats, the token copies that cross the
node level: hierarchical dispatch sends one per (token, destination node); flat EP sends one per
(token, destination rank). Prints a markdown table (recorded in docs/benchmarks.md).

    python examples/traffic_report.py [--tokens=256] [--hidden=7168]
"""

from __future__ import annotations

import jax

jax.config.update("jax_num_cpu_devices", 64)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags, logging  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_hybridep as hep  # noqa: E402
from jax_hybridep import nn as hnn  # noqa: E402
from jax_hybridep import traffic  # noqa: E402

flags.DEFINE_integer(
    "tokens", 64, "tokens per rank (scaled down from DeepSeek-V3's 4096)", lower_bound=1
)
flags.DEFINE_integer("hidden", 7168, "hidden size, for the byte counts", lower_bound=1)
flags.DEFINE_integer("seed", 0, "random seed of the gate logits")
FLAGS = flags.FLAGS
NODES, LOCAL, EXPERTS, TOP_K, NODES_PER_TOKEN = 8, 8, 256, 8, 4


def node_level_copies(mesh, levels, logits):
    """Summed over ranks: token copies sent across the node level (and the rank level)."""
    topo = hep.Topology.from_mesh(mesh, levels)
    router = hnn.RouterConfig(
        num_experts=EXPERTS,
        top_k=TOP_K,
        score_fn="sigmoid",
        num_groups=NODES,
        topk_groups=NODES_PER_TOKEN,
    )
    cfg = hep.DispatchConfig(num_experts=EXPERTS, backend="xla")

    def step(logits):
        r = hnn.route(logits, jnp.zeros(EXPERTS), router)
        x = jnp.zeros((logits.shape[0], 1), jnp.bfloat16)  # payload size does not change counts
        d = hep.dispatch(x, r.topk_idx, r.topk_weights, topology=topo, config=cfg)
        return d.stats.level_rows[None], r.topk_idx

    spec = P(("node", "local"))
    rows, idx = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=spec, out_specs=spec))(logits)
    return np.asarray(rows).sum(axis=0), np.asarray(idx)


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    devices = np.asarray(jax.devices()[: NODES * LOCAL]).reshape(NODES, LOCAL)
    mesh = jax.sharding.Mesh(devices, ("node", "local"), axis_types=(AxisType.Auto,) * 2)
    n = NODES * LOCAL * FLAGS.tokens
    logits = jax.random.normal(jax.random.key(FLAGS.seed), (n, EXPERTS), jnp.float32)
    logits = jax.device_put(logits, NamedSharding(mesh, P(("node", "local"))))

    hier_rows, idx = node_level_copies(mesh, ("node", "local"), logits)
    flat_rows, _ = node_level_copies(mesh, (("node", "local"),), logits)
    per_rank = EXPERTS // (NODES * LOCAL)
    src = np.repeat(np.arange(NODES * LOCAL), FLAGS.tokens)[:, None]
    dest = idx // per_rank  # dropless: every id is kept
    flat_cross_node = sum(  # flat EP: one copy per (token, rank on another node)
        len({int(d) for d in dest[t] if d // LOCAL != src[t, 0] // LOCAL}) for t in range(n)
    )
    node_bytes = traffic.level_bytes(hier_rows[0], FLAGS.hidden, jnp.bfloat16)
    flat_bytes = traffic.level_bytes(flat_cross_node, FLAGS.hidden, jnp.bfloat16)
    print(
        f"DeepSeek-V3 routing: {EXPERTS} experts, top-{TOP_K}, {NODES_PER_TOKEN} of {NODES} "
        f"nodes per token; mesh node={NODES} x local={LOCAL}; {FLAGS.tokens} tokens/rank; "
        f"H={FLAGS.hidden} bf16"
    )
    print("| | copies crossing the node level | bytes | copies inside nodes |")
    print("|---|---|---|---|")
    print(
        f"| hierarchical (node, local) | {hier_rows[0]} | {node_bytes / 1e6:.1f} MB | "
        f"{hier_rows[1]} |"
    )
    print(
        f"| flat EP (node x local) | {flat_cross_node} | {flat_bytes / 1e6:.1f} MB | "
        f"{int(flat_rows[0]) - flat_cross_node} |"
    )
    print(f"ratio flat / hierarchical across nodes: {flat_cross_node / hier_rows[0]:.2f}x")


if __name__ == "__main__":
    app.run(main)
