"""Quickstart: dispatch -> per-expert FFN -> combine on an EP mesh, checked against a dense MoE.

Runs on all local GPUs when there are any (the `xla` backend there until the CUDA handlers land),
otherwise on 8 fake CPU devices with the `ffi` backend (C++ host handlers, direct-write exchange).

    python examples/quickstart.py [--backend=auto|xla|ffi] [--num_experts=32] [--top_k=4] ...
"""

from __future__ import annotations

import math
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)  # fake CPU devices; ignored when GPUs are present

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags, logging  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_hybridep as hep  # noqa: E402

flags.DEFINE_enum("backend", "auto", ["auto", "xla", "ffi"], "dispatch/combine backend")
flags.DEFINE_integer(
    "num_experts", 32, "global experts (a multiple of the device count)", lower_bound=1
)
flags.DEFINE_integer("top_k", 4, "experts per token", lower_bound=1)
flags.DEFINE_integer("tokens", 256, "tokens per device", lower_bound=1)
flags.DEFINE_integer("hidden", 128, "model width", lower_bound=1)
flags.DEFINE_integer("ffn", 256, "expert FFN width", lower_bound=1)
flags.DEFINE_float("capacity_factor", None, "per-expert capacity factor; unset means dropless")
flags.register_validator(
    "capacity_factor",
    lambda f: f is None or (math.isfinite(f) and f > 0),
    message="--capacity_factor must be a finite number > 0 (omit it for dropless)",
)
flags.DEFINE_integer("seed", 0, "random seed")
FLAGS = flags.FLAGS


def expert_ffn(tokens, group_sizes, w_in, w_out):
    """GELU FFN per local expert over expert-major rows (ragged_dot; rows past the groups: 0)."""
    h = jax.nn.gelu(jax.lax.ragged_dot(tokens, w_in, group_sizes))
    return jax.lax.ragged_dot(h, w_out, group_sizes)


def dense_reference(x, topk_idx, topk_weights, kept, w_in, w_out):
    """Every token through each of its kept top-k experts, densely (no dispatch)."""
    h = jax.nn.gelu(jnp.einsum("nh,ehf->nef", x, w_in))
    y = jnp.einsum("nef,efh->neh", h, w_out)
    gates = (
        jnp.zeros((x.shape[0], w_in.shape[0]))
        .at[jnp.arange(x.shape[0])[:, None], topk_idx]
        .add(jnp.where(kept, topk_weights, 0.0))
    )
    return jnp.einsum("ne,neh->nh", gates, y)


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    devices = jax.devices()
    mesh = jax.make_mesh((len(devices),), ("ep",), axis_types=(AxisType.Auto,), devices=devices)
    topo = hep.Topology.from_mesh(mesh, levels=("ep",))
    cfg = hep.DispatchConfig(
        num_experts=FLAGS.num_experts, capacity_factor=FLAGS.capacity_factor, backend=FLAGS.backend
    )
    n, e, k = FLAGS.tokens * len(devices), FLAGS.num_experts, FLAGS.top_k

    keys = jax.random.split(jax.random.key(FLAGS.seed), 4)
    x = jax.random.normal(keys[0], (n, FLAGS.hidden), jnp.float32)
    router = jax.random.normal(keys[1], (FLAGS.hidden, e), jnp.float32)
    w_in = jax.random.normal(keys[2], (e, FLAGS.hidden, FLAGS.ffn)) / np.sqrt(FLAGS.hidden)
    w_out = jax.random.normal(keys[3], (e, FLAGS.ffn, FLAGS.hidden)) / np.sqrt(FLAGS.ffn)
    topk_weights, topk_idx = jax.lax.top_k(jax.nn.softmax(x @ router), k)

    def moe_block(x, topk_idx, topk_weights, w_in, w_out):
        d = hep.dispatch(x, topk_idx, topk_weights, topology=topo, config=cfg)
        y = expert_ffn(d.tokens, d.group_sizes, w_in, w_out)
        out = hep.combine(y, d.handle, weights=d.weights)
        return out, d.kept, d.stats.dropped[None], d.stats.tokens_per_expert[None]

    spec = P("ep")
    step = jax.jit(jax.shard_map(moe_block, mesh=mesh, in_specs=(spec,) * 5, out_specs=(spec,) * 4))
    args = [
        jax.device_put(a, NamedSharding(mesh, spec))
        for a in (x, topk_idx, topk_weights, w_in, w_out)
    ]
    out, kept, dropped, per_expert = jax.block_until_ready(step(*args))
    start = time.perf_counter()
    jax.block_until_ready(step(*args))
    seconds = time.perf_counter() - start

    targets = {
        t
        for t in ("layout", "dispatch", "combine")
        if f"jax_hybridep_{t}" in step.lower(*args).compile().as_text()
    }
    ran = "ffi (XLA FFI custom calls)" if targets else "xla (all_to_all)"
    ref = dense_reference(x, topk_idx, topk_weights, kept, w_in, w_out)
    err = float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))
    print(f"devices      : {len(devices)} x {devices[0].platform}  (EP size {topo.ep_size})")
    print(f"backend      : {ran}")
    print(
        f"tokens       : {n} ({FLAGS.tokens}/device), hidden {FLAGS.hidden}, experts {e}, top-{k}"
    )
    print(f"rows/expert  : min {int(per_expert[0].min())}, max {int(per_expert[0].max())}")
    print(f"dropped rows : {int(dropped.sum())}")
    print(f"step time    : {seconds * 1e3:.1f} ms (dispatch + expert FFN + combine)")
    print(f"max rel. err : {err:.2e} against the dense MoE (same kept rows)")
    if err > 1e-4:
        raise SystemExit(f"mismatch against the dense reference: {err}")
    print("OK")


if __name__ == "__main__":
    app.run(main)
