"""`python -m jax_hybridep.bench.layer`: a whole MoE layer, forward + backward, two ways.

dispatch -> grouped GEMM (`jax.lax.ragged_dot` over the local experts) -> combine, with the
gradients of the tokens, routing weights and expert weights, on one flat EP axis over the devices
present:

* `hybridep-<backend>`: `hep.dispatch` / `hep.combine` (dropless, or a capacity factor);
* `ragged`: the same layer written the way MaxText writes it: tokens expanded xK and sorted by
  expert, exchanged with `ragged_all_to_all` (on CPU, where XLA cannot compile it, a padded dense
  `all_to_all` of worst-case T*K rows per peer), sorted again by local expert for `ragged_dot`,
  and back. Dropless.

Both compute the same function, checked against a float32 numpy model of the layer (each
method's loss error relative to it, dropless only); the ratio is the layer's time beside the
baseline's in the same run. On GPUs this shows what the transport's few SMs and the overlap it
leaves buy; on fake CPU devices it is a smoke test of the comparison.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import platform

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_hybridep as hep
from jax_hybridep.bench import baselines, cli, report, runner

AXIS = "ep"


@dataclasses.dataclass(frozen=True)
class LayerShape:
    tokens: int = 512  # per device
    hidden: int = 256
    ffn: int = 256
    experts_per_device: int = 4
    k: int = 4
    dtype: str = "bfloat16"


def _inputs(shape: LayerShape, devices: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    n, e = shape.tokens * devices, shape.experts_per_device * devices
    x = rng.standard_normal((n, shape.hidden)).astype(np.float32)
    idx = np.stack([rng.permutation(e)[: shape.k] for _ in range(n)]).astype(np.int32)
    w = rng.random((n, shape.k)).astype(np.float32)
    experts = (rng.standard_normal((e, shape.hidden, shape.ffn)) / np.sqrt(shape.hidden)).astype(
        np.float32
    )
    proj = (rng.standard_normal((shape.ffn, shape.hidden)) / np.sqrt(shape.ffn)).astype(np.float32)
    return x, idx, w, experts, proj


def _gelu(v: np.ndarray) -> np.ndarray:
    """jax.nn.gelu's default (tanh) approximation."""
    return 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v**3)))


def reference_loss(x, idx, w, experts, proj, ct) -> float:
    """The layer's loss in float32 numpy (sum in float64), dropless: out[t] = sum_k w[t, k] *
    gelu(x[t] @ experts[idx[t, k]]) @ proj, loss = sum(out * ct). Inputs as the methods see them
    (already rounded to the benchmark dtype)."""
    x, experts, proj = (np.asarray(a, np.float32) for a in (x, experts, proj))
    out = np.zeros((x.shape[0], proj.shape[1]), np.float32)
    for e in range(experts.shape[0]):
        t, k = np.nonzero(idx == e)
        y = _gelu(x[t] @ experts[e]) @ proj
        np.add.at(out, t, y * w[t, k][:, None])
    return float(np.sum(out.astype(np.float64) * np.asarray(ct, np.float64)))


def _hybridep_layer(topo, experts: int, backend: str, capacity_factor):
    cfg = hep.DispatchConfig(num_experts=experts, backend=backend, capacity_factor=capacity_factor)

    def layer(x, idx, w, w_local, proj):
        d = hep.dispatch(x, idx, w, topology=topo, config=cfg)
        h = jax.lax.ragged_dot(d.tokens, w_local, d.group_sizes)
        y = jnp.dot(jax.nn.gelu(h), proj).astype(x.dtype)
        return hep.combine(y, d.handle, weights=d.weights)

    return layer


def _ragged_layer(ranks: int, experts: int, ragged: bool):
    """MaxText's way: expand, sort by expert, ragged all-to-all, sort by local expert, GEMM."""
    local = experts // ranks

    def layer(x, idx, w, w_local, proj):
        t, k = idx.shape
        h_dim = x.shape[1]
        order, dest, counts, starts, slot = baselines._sorted_layout(idx, ranks, experts)
        rows = x[order // k]
        expert_sorted = idx.reshape(-1)[order]
        if ragged:
            recv_counts = jax.lax.all_to_all(counts, AXIS, 0, 0, tiled=True)
            recv_starts = jax.lax.all_to_all(starts, AXIS, 0, 0, tiled=True)
            me = jax.lax.axis_index(AXIS)
            out_off = jnp.full(ranks, me * t * k, jnp.int32)
            buf = jnp.zeros((ranks * t * k, h_dim), x.dtype)
            recv = jax.lax.ragged_all_to_all(
                rows, buf, starts, counts, out_off, recv_counts, axis_name=AXIS
            )
            ebuf = jnp.full((ranks * t * k,), -1, jnp.int32)
            recv_e = jax.lax.ragged_all_to_all(
                expert_sorted, ebuf, starts, counts, out_off, recv_counts, axis_name=AXIS
            )
        else:
            send = jnp.zeros((ranks, t * k, h_dim), x.dtype).at[dest, slot].set(rows)
            recv = jax.lax.all_to_all(send, AXIS, 0, 0, tiled=True).reshape(-1, h_dim)
            send_e = jnp.full((ranks, t * k), -1, jnp.int32).at[dest, slot].set(expert_sorted)
            recv_e = jax.lax.all_to_all(send_e, AXIS, 0, 0, tiled=True).reshape(-1)
        # Received rows grouped by local expert for the grouped GEMM (empty slots last).
        local_e = jnp.where(recv_e >= 0, recv_e % local, local)
        perm = jnp.argsort(local_e, stable=True)
        sizes = jnp.zeros(local + 1, jnp.int32).at[local_e].add(1)[:local]
        hid = jax.lax.ragged_dot(recv[perm], w_local, sizes)
        y_perm = jnp.dot(jax.nn.gelu(hid), proj).astype(x.dtype)
        valid = (jnp.arange(recv.shape[0]) < jnp.sum(sizes))[:, None]
        y = jnp.zeros_like(recv).at[perm].set(jnp.where(valid, y_perm, 0))
        if ragged:
            src_off = jnp.arange(ranks, dtype=jnp.int32) * t * k
            back = jax.lax.ragged_all_to_all(
                y, jnp.zeros_like(rows), src_off, recv_counts, recv_starts, counts, axis_name=AXIS
            )
        else:
            back = jax.lax.all_to_all(y.reshape(ranks, t * k, h_dim), AXIS, 0, 0, tiled=True)
            back = back[dest, slot]
        y_exp = jnp.zeros_like(back).at[order].set(back).reshape(t, k, h_dim)
        out = jnp.einsum("tkh,tk->th", y_exp.astype(jnp.float32), w.astype(jnp.float32))
        return out.astype(x.dtype)

    return layer


def _program(layer, mesh):
    """jit(shard_map(value and gradients)) of a per-shard layer."""

    def step(x, idx, w, experts, proj, ct):
        def loss(x, w, experts, proj):
            out = layer(x, idx, w, experts, proj)
            return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32))

        value, grads = jax.value_and_grad(loss, (0, 1, 2, 3))(x, w, experts, proj)
        return jax.lax.psum(value, AXIS)[None], grads[:3]

    spec = P(AXIS)
    in_specs = (spec, spec, spec, spec, P(), spec)
    out_specs = (spec, (spec, spec, spec))
    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


def measure(
    shape: LayerShape,
    backends=("ffi", "xla"),
    capacity_factor=None,
    warmup=2,
    repeats=5,
    devices=None,
) -> dict:
    devices = devices or jax.devices()
    n = len(devices)
    mesh = jax.make_mesh((n,), (AXIS,), (AxisType.Auto,), devices=devices)
    topo = hep.Topology.from_mesh(mesh, levels=(AXIS,))
    experts = shape.experts_per_device * n
    dtype = jnp.dtype(shape.dtype)
    x, idx, w, ew, proj = _inputs(shape, n)
    ct = np.random.default_rng(1).standard_normal(x.shape).astype(np.float32)
    sharded = NamedSharding(mesh, P(AXIS))
    args = (
        jax.device_put(jnp.asarray(x, dtype), sharded),
        jax.device_put(jnp.asarray(idx), sharded),
        jax.device_put(jnp.asarray(w), sharded),
        jax.device_put(jnp.asarray(ew, dtype), sharded),
        jax.device_put(jnp.asarray(proj, dtype), NamedSharding(mesh, P())),
        jax.device_put(jnp.asarray(ct, dtype), sharded),
    )
    ragged = devices[0].platform == "gpu"
    methods = {
        f"hybridep-{b}": _hybridep_layer(topo, experts, b, capacity_factor) for b in backends
    }
    methods["ragged" if ragged else "ragged (padded all_to_all on CPU)"] = _ragged_layer(
        n, experts, ragged
    )
    rows, results = [], {}
    for name, layer in methods.items():
        compiled = _program(layer, mesh).lower(*args).compile()
        median, times, out = runner.time_call(compiled, args, warmup, repeats)
        results[name] = jax.device_get(out)
        rows.append(dict(method=name, median_ms=median * 1e3, times_ms=[t * 1e3 for t in times]))
    baseline = rows[-1]["median_ms"]
    # Dropped rows (a capacity factor) are not in the model.
    reference = None
    if capacity_factor is None:
        # The arrays rounded to the dtype, as the methods see them (idx and w are unchanged).
        x_in, _, _, experts_in, proj_in, ct_in = jax.device_get(args)
        reference = reference_loss(x_in, idx, w, experts_in, proj_in, ct_in)
    for row in rows:
        row["vs_ragged"] = baseline / row["median_ms"]
        value = float(results[row["method"]][0][0])  # every shard holds the psum
        row["loss"] = value
        row["loss_rel_err"] = None if reference is None else abs(value - reference) / abs(reference)
    return dict(
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        machine=f"{n} x {devices[0].device_kind} ({devices[0].platform}), {platform.node()}",
        shape=dataclasses.asdict(shape),
        capacity_factor=capacity_factor,
        reference_loss=reference,
        rows=rows,
    )


def table(result: dict) -> str:
    lines = [
        f"{result['machine']}  {result['date']}  {result['shape']}",
        f"{'method':<36} {'median ms':>10} {'vs ragged':>10} {'loss err vs f32':>16}",
    ]
    for row in result["rows"]:
        err = "-" if row["loss_rel_err"] is None else f"{row['loss_rel_err']:.2e}"
        lines.append(
            f"{row['method']:<36} {row['median_ms']:>10.2f} {row['vs_ragged']:>9.2f}x {err:>16}"
        )
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for field in dataclasses.fields(LayerShape):
        if field.name == "dtype":
            p.add_argument(
                "--dtype", choices=("bfloat16", "float32", "float16"), default=field.default
            )
        else:
            p.add_argument(f"--{field.name}", type=cli.positive_int, default=field.default)
    p.add_argument("--backends", type=cli.choice_list(("ffi", "xla")), default=["ffi", "xla"])
    p.add_argument(
        "--capacity_factor", type=cli.positive_float, default=None, help="default: dropless"
    )
    p.add_argument("--warmup", type=cli.nonnegative_int, default=2)
    p.add_argument("--repeats", type=cli.positive_int, default=5)
    p.add_argument("--json", type=cli.output_path, default="", help="JSON output path ('' to skip)")
    args = p.parse_args(argv)
    shape = LayerShape(**{f.name: getattr(args, f.name) for f in dataclasses.fields(LayerShape)})
    result = measure(shape, tuple(args.backends), args.capacity_factor, args.warmup, args.repeats)
    if args.json:
        report.write_json(result, args.json)
    print(table(result))
    return result


if __name__ == "__main__":
    import os
    import sys

    if os.environ.get("JAX_PLATFORMS", "") in ("", "cpu") and "--help" not in sys.argv:
        jax.config.update("jax_num_cpu_devices", 8)  # fake CPU devices, as the bench CLI
    main()
