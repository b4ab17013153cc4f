"""The bytes the cross-DC job reports: what crosses the DC level per rank and step, measured (the
compiled step, the run-time token copies) and predicted (`xdc.volumes` fed the run's routing).

* experts: the all-gather, the gradients' reduce-scatter (an all-to-all of top-k blocks with
  gradient compression), read off the compiled step;
* all-reduce: the "mean" SR reference's sync, the persistent shared expert's refresh (it runs
  inside a conditional once every `sync_every` steps: counted over that many) and the dense
  data-parallel gradients, read off the compiled step (the scalar losses and integer counters,
  a few hundred bytes, are reported apart and not modelled);
* tokens: the first step's run-time copy counts, predicted from that step's routing (replayed
  from the initial model and batch, so the prediction uses the run's routing, not a uniform one).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from examples.job_runtime.startup import global_devices
from examples.moe_lm.data import ByteData, ShardFeeder
from examples.moe_lm.model import MoETransformer, dense_param_bytes, make_mesh
from examples.train_moe.config import TrainConfig
from jax_hybridep import nn as hnn
from jax_hybridep import traffic, xdc
from jax_hybridep.nn.router import route
from jax_hybridep.xdc.runtime import migrate

ACT_BYTES = 4  # the example model's float32 activations and parameters


def first_step(cfg: TrainConfig) -> tuple[int, list[np.ndarray]]:
    """(dense parameter bytes, per MoE layer the [ranks, T, K] routing of the first step).

    Replays the first training step's forward pass from the same initial model and batch as
    `train(cfg)` and routes each MoE block's input as the block does. Values with full-expert
    domains equal plain EP's, so those runs route their first step alike; with SR the layers
    after the first route what lossy replicas made (at a DC-level domain no token crosses the
    DC level, so the tokens' prediction is 0 either way)."""
    mesh, topology = make_mesh(cfg.mesh, global_devices())
    ranks = mesh.devices.size
    model = MoETransformer(cfg.built_model, mesh, topology, rngs=nnx.Rngs(cfg.seed))
    dense = dense_param_bytes(nnx.state(model, nnx.Param))
    # Global arrays, so that this runs alike in one process or in each of several.
    sharding = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    feeder = ShardFeeder(ByteData.load(), sharding, cfg.batch, cfg.seq_len)
    inputs, _ = feeder.train_batch(cfg.seed, 0)
    graphdef, state = nnx.split(model)
    state = jax.device_put(state, nnx.get_named_sharding(state, mesh))
    call = hnn.MoEBlock.__call__

    def routing(state, inputs):
        seen = []

        def recording(block, x, experts=None):  # routes the block's input as the block does
            tokens = x.reshape(-1, x.shape[-1]).astype(block.dtype).astype(jnp.float32)
            logits = jnp.dot(tokens, block.router.gate[...].astype(jnp.float32))
            seen.append(route(logits, block.router.bias[...], block.router.config).topk_idx)
            return call(block, x, experts)

        hnn.MoEBlock.__call__ = recording
        try:
            nnx.merge(graphdef, state)(inputs)
        finally:
            hnn.MoEBlock.__call__ = call
        return seen

    routing = jax.jit(routing, out_shardings=NamedSharding(mesh, P()))  # each process: all of it
    per_layer = [np.asarray(idx) for idx in routing(state, inputs)]
    return dense, [idx.reshape(ranks, -1, idx.shape[-1]) for idx in per_layer]


def _parameter_array(kind: str, shape) -> bool:
    """Float arrays of rank >= 1: gradients and expert weights, not the scalar losses."""
    return kind.startswith(("f", "bf")) and len(shape) >= 1


def program_bytes(hlo_text: str, sync_every: int = 1) -> dict[str, float]:
    """The compiled step's parameter bytes across the DC level per rank and step: experts
    (gather, reduce-scatter or compressed all-to-all) and all-reduce (SR reference, the dense
    gradients); and the scalar metrics' all-reduce apart."""
    axes = {"dc", "dc" + xdc.domains.INNER_SUFFIX}
    every = traffic.crossing_bytes(hlo_text, axes)
    params = traffic.crossing_bytes(hlo_text, axes, operands=_parameter_array)
    refresh = traffic.crossing_bytes(hlo_text, axes, op_name=migrate.REFRESH_SCOPE)["all-reduce"]
    grads = traffic.crossing_bytes(hlo_text, axes, op_name=migrate.SCATTER_SCOPE)["all-to-all"]
    return dict(
        experts=every["all-gather"] + every["reduce-scatter"] + grads,
        all_reduce=params["all-reduce"] - refresh + refresh / sync_every,
        metrics=every["all-reduce"] - params["all-reduce"],
    )


def measure(
    hlo_text: str, result: dict, token_levels, hidden: int, ranks: int, sync_every: int = 1
) -> dict[str, float]:
    """Bytes one rank receives across the DC level per step, measured (see the module doc).

    `token_levels`: the mesh levels tokens cross in this run (the "dc" level or not); `ranks`:
    the devices the token copies are averaged over."""
    program = program_bytes(hlo_text, sync_every)
    tokens = mean = 0.0
    if "dc" in token_levels:
        level = list(token_levels).index("dc")
        rows = [r["level_rows"][level] for r in result["train"]]
        per_copy = 4 * hidden * ACT_BYTES / ranks  # 4 exchanges a step, mean over ranks
        tokens, mean = rows[0] * per_copy, float(np.mean(rows)) * per_copy
    experts, all_reduce = program["experts"], program["all_reduce"]
    return dict(
        experts=experts,
        all_reduce=all_reduce,
        tokens=tokens,
        total=experts + all_reduce + tokens,
        metrics=program["metrics"],
        tokens_mean=mean,
    )


def predict(cluster, workload: xdc.Workload, sizes, routing: list[np.ndarray]) -> dict:
    """The same bytes from `xdc.volumes` fed each layer's first-step routing."""
    layers = [workload.volumes(cluster.level_sizes, sizes, idx) for idx in routing]
    dc = [v.levels[0] for v in layers]
    experts = sum(v.gather_bytes + v.reduce_scatter_bytes for v in dc)
    refresh = sum(v.shared_refresh_bytes for v in dc) / workload.migration.sync_every
    all_reduce = sum(v.shared_sync_bytes for v in dc) + refresh + dc[0].dense_sync_bytes
    tokens = sum(4 * v.token_bytes for v in dc)
    return dict(
        experts=experts,
        all_reduce=all_reduce,
        dense=dc[0].dense_sync_bytes,
        tokens=tokens,
        total=experts + all_reduce + tokens,
    )
