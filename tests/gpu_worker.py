"""Worker of tests/gpu_jax_test.py: dispatch/combine through the CUDA handlers on real GPUs.

Run as `JAX_PLATFORMS=cuda python tests/gpu_worker.py --devices N` (one process driving N local
GPUs as one EP group), or as one of N processes with one GPU each (`--process_id I
--num_processes N --port P`: jax.distributed on 127.0.0.1, the EP group spans the processes and
the CUDA transport reaches the other processes' windows by CUDA IPC). For float32 and bfloat16,
dropless and a capacity, weighted and unweighted combine, it runs the MoE block of
tests/harness.py on the ffi backend (CUDA handlers) and on the xla backend, values and gradients,
and twice on ffi (the registered windows are reused); `--levels=hier` splits the GPUs as
(node=2, local=N/2), the node level going through XLA all-to-alls. `--train` also trains the
example MoE LM (the main job, `examples/train_moe/`) a few steps on both backends (the `examples`
package imported from the repository root: on PYTHONPATH, as tests/gpu_jax_test.py and
scripts/gpu_check.sh set it). Prints one JSON line: per
case, whether dispatch outputs are bitwise equal, the largest relative combine/gradient
difference, whether those are bitwise, and whether the program ran the CUDA handlers; the
training losses of both backends; whether the FP8 element step (`fp8.cast`, compiled for this
platform) gives ml_dtypes' bits over every bfloat16 pattern; and whether FP8 dispatch of every
bfloat16 pattern (on GPUs quantised and dequantised by the CUDA transport's kernels) gives the
xla backend's bits; and how many per-site states of the CUDA handlers the re-jitted block
holds (one per CUDA call site of the program alive, none once it is gone).
"""

from __future__ import annotations

import argparse
import gc
import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from harness import all_axes_spec, make_mesh, moe_fn, random_routing
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_hybridep as hep
from jax_hybridep import _native, fp8
from lab import native_module


def _global(mesh, a, spec):
    """A numpy array as a global array sharded over `mesh` (every process holds all of `a`)."""
    return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda i: a[i])


def _run(mesh, topo, backend, dtype, capacity, weighted, args, wire_dtype=None):
    E = args.experts_per_gpu * mesh.size
    cfg = hep.DispatchConfig(
        num_experts=E, capacity_factor=capacity, backend=backend, wire_dtype=wire_dtype
    )
    fn = moe_fn(mesh, topo, cfg, weighted_combine=weighted)
    x, idx, w, experts = args.inputs(E, dtype)
    spec = all_axes_spec(mesh)
    x, idx, w = (_global(mesh, a, spec) for a in (x, idx, w))
    experts = _global(mesh, experts, P(topo.ep_axes))

    def loss(x, w, idx, experts):
        return jnp.sum(fn(x, idx, w, experts)[0].astype(jnp.float32) ** 2)

    out, stacked = fn(x, idx, w, experts)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w, idx, experts)
    hlo = fn.lower(x, idx, w, experts).as_text()
    gathered = multihost_utils.process_allgather((out, stacked, grads), tiled=True)
    return jax.device_get(gathered), "jax_hybridep_cuda_dispatch" in hlo


def _bitwise(a, b) -> bool:
    return all(
        np.array_equal(np.asarray(p).view(np.uint8), np.asarray(q).view(np.uint8))
        for p, q in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def _max_diff(a, b) -> float:
    """Largest |a - b| over the leaves, relative to the largest |b| of its leaf."""
    worst = 0.0
    for p, q in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        p, q = np.asarray(p, np.float32), np.asarray(q, np.float32)
        scale = max(float(np.max(np.abs(q), initial=0)), 1e-30)
        worst = max(worst, float(np.max(np.abs(p - q), initial=0)) / scale)
    return worst


def _train(n, names):
    """Training losses of the example MoE LM on both backends (a few steps, tiny sizes)."""
    from rich.console import Console  # noqa: PLC0415

    from examples.moe_lm.model import ModelConfig  # noqa: PLC0415  (the root on PYTHONPATH)
    from examples.train_moe import job  # noqa: PLC0415

    mesh = ",".join(
        f"{a}={s}" for a, s in zip(names, (n,) if len(names) == 1 else (2, n // 2), strict=True)
    )
    losses = {}
    for backend in ("ffi", "xla"):
        cfg = job.TrainConfig(
            steps=8,
            batch=8,
            seq_len=32,
            model=ModelConfig(d_model=64, d_ff=64, layers=2, heads=2, backend=backend),
            mesh=mesh,
            eval_every=4,
            eval_batches=2,
            progress=False,
            output_dir=f"/tmp/jax_hybridep_gpu_train_{backend}",
        )
        metrics = job.train(cfg, console=Console(file=open(os.devnull, "w")))  # noqa: SIM115
        losses[backend] = dict(
            backend=metrics["backend"], train=[r["loss"] for r in metrics["train"]]
        )
    return losses


def _site_states(mesh, topo, args) -> dict:
    """Live per-site states of the CUDA handlers (xla_ffi/cuda/site_state.h) while the MoE block is
    re-jitted (a new trace and new call sites each time, as a retraced model): each
    program holds one per CUDA call site, and none outlives its program. None without CUDA."""
    if not _native.module().with_cuda:
        return None
    testing = native_module.testing_module()
    E = args.experts_per_gpu * mesh.size
    x, idx, w, experts = args.inputs(E, jnp.float32)
    spec = all_axes_spec(mesh)
    x, idx, w = (_global(mesh, a, spec) for a in (x, idx, w))
    experts = _global(mesh, experts, P(topo.ep_axes))
    gc.collect()
    base = testing.live_site_states()
    per_program = []
    # Four on GPUs; two where the CUDA handlers do not run (the CPU check of this worker).
    for _ in range(4 if jax.devices()[0].platform == "gpu" else 2):
        fn = moe_fn(mesh, topo, hep.DispatchConfig(num_experts=E, backend="ffi"))
        jax.block_until_ready(fn(x, idx, w, experts))
        per_program.append(testing.live_site_states() - base)
        del fn
        gc.collect()
    return dict(per_program=per_program, after=testing.live_site_states() - base)


def _fp8_element_bitwise() -> bool:
    """fp8.cast on this platform against ml_dtypes' round-to-nearest-even cast (docs/design.md
    §2.1.8), over every bfloat16 bit pattern at a few fixed scales."""
    x = np.arange(1 << 16, dtype=np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)
    ok = True
    for amax in (1e-4, 0.37, 1.0, 448.0, 3.0e4):
        inv = np.float32(448.0) / np.float32(amax)
        got = np.asarray(jax.jit(fp8.cast)(x, inv)).view(np.uint8)
        with np.errstate(invalid="ignore", over="ignore"):
            want = np.clip(x * inv, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        ok = ok and np.array_equal(got, want)
    return bool(ok)


def _fp8_rows_of_every_pattern(mesh, topo):
    """FP8 dispatch of every bfloat16 bit pattern, the ffi backend (on GPUs: the CUDA send kernel
    quantises, the receive kernel dequantises) against the xla backend (jnp): tokens of H = 128
    in pattern order (blocks of like magnitude, NaN and Inf among them) and of H = 200 shuffled
    (short last blocks, tiny values beside large ones). Returns whether the e4m3fn rows and scales
    (fp8_rows) are bitwise equal, and the dequantised rows bitwise apart from NaN payloads."""
    patterns = np.arange(1 << 16, dtype=np.uint16).view(ml_dtypes.bfloat16)
    shuffled = np.random.default_rng(7).permutation(patterns)
    n, spec = mesh.size, all_axes_spec(mesh)
    exact = nan_exact = True
    for values, hidden in ((patterns, 128), (shuffled, 200)):
        tokens = -(-values.size // (hidden * n)) * n
        x = np.resize(values, tokens * hidden).reshape(tokens, hidden)
        idx = (np.arange(tokens, dtype=np.int32) % n)[:, None]  # one row per token, every rank
        w = np.ones((tokens, 1), np.float32)
        x, idx, w = (_global(mesh, a, spec) for a in (x, idx, w))
        for fp8_rows in (True, False):
            got = []
            for backend in ("ffi", "xla"):
                cfg = hep.DispatchConfig(
                    num_experts=n, backend=backend, wire_dtype="float8_e4m3fn", fp8_rows=fp8_rows
                )

                def rows(x, idx, w, cfg=cfg):
                    d = hep.dispatch(x, idx, w, topology=topo, config=cfg)
                    return d.tokens if d.scales is None else (d.tokens, d.scales)

                fn = jax.jit(jax.shard_map(rows, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))
                got.append(multihost_utils.process_allgather(fn(x, idx, w), tiled=True))
            if fp8_rows:
                exact = exact and _bitwise(*got)
            else:
                a, b = (np.asarray(r, np.float32) for r in got)
                same = np.asarray(got[0]).view(np.uint16) == np.asarray(got[1]).view(np.uint16)
                nan_exact = nan_exact and bool(np.all(same | (np.isnan(a) & np.isnan(b))))
    return dict(fp8_rows_bitwise=bool(exact), rows_bitwise_but_nan=nan_exact)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--experts_per_gpu", type=int, default=4)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--levels", choices=("flat", "hier"), default="flat")
    p.add_argument("--train", action="store_true")
    # smoke: one variant per code path (CPU runs of the worker itself); all: every variant.
    p.add_argument("--variants", choices=("all", "smoke"), default="all")
    p.add_argument("--process_id", type=int, default=None)
    p.add_argument("--num_processes", type=int, default=1)
    p.add_argument("--port", type=int, default=None)
    args = p.parse_args()
    if args.process_id is not None:  # one GPU per process
        jax.distributed.initialize(
            f"127.0.0.1:{args.port}",
            num_processes=args.num_processes,
            process_id=args.process_id,
            local_device_ids=[args.process_id],
        )
    n = len(jax.devices()) if args.process_id is not None else args.devices
    shape, names = ((n,), ("ep",)) if args.levels == "flat" else ((2, n // 2), ("node", "local"))
    mesh = make_mesh(shape, names)
    topo = hep.Topology.from_mesh(mesh, names)
    rng = np.random.default_rng(0)

    def inputs(E, dtype):
        idx, w = random_routing(rng, n * args.tokens, min(args.k, E), E, invalid_fraction=0.05)
        x = rng.standard_normal((n * args.tokens, args.hidden)).astype(np.float32)
        experts = rng.standard_normal((E, args.hidden, args.hidden)).astype(np.float32) * 0.05
        return x.astype(dtype), idx, w, experts.astype(dtype)

    args.inputs = inputs
    cases = {}
    variants = [
        (dtype, capacity, weighted, None)
        for dtype in (jnp.float32, jnp.bfloat16)
        for capacity in (None, 1.0)
        for weighted in (True, False)
    ]
    # FP8 on the wire: bf16 tokens, both capacity modes, weighted combine.
    variants += [(jnp.bfloat16, capacity, True, "float8_e4m3fn") for capacity in (None, 1.0)]
    if args.variants == "smoke":  # f32 dropless weighted, bf16 capacity unweighted, FP8 capacity
        smoke = {
            (jnp.float32, None, True, None),
            (jnp.bfloat16, 1.0, False, None),
            (jnp.bfloat16, 1.0, True, "float8_e4m3fn"),
        }
        variants = [v for v in variants if v in smoke]
    for dtype, capacity, weighted, wire in variants:
        name = f"{jnp.dtype(dtype).name}_cap{capacity}_weighted{weighted}"
        name += "_fp8" if wire else ""
        run = (dtype, capacity, weighted, args, wire)
        state = rng.bit_generator.state
        ffi, ran_cuda = _run(mesh, topo, "ffi", *run)
        rng.bit_generator.state = state
        again, _ = _run(mesh, topo, "ffi", *run)
        rng.bit_generator.state = state
        ref, _ = _run(mesh, topo, "xla", *run)
        (out, stacked, grads), (ref_out, ref_stacked, ref_grads) = ffi, ref
        cases[name] = dict(
            ran_cuda=ran_cuda,
            dispatch_bitwise=_bitwise(stacked, ref_stacked),
            rerun_bitwise=_bitwise(ffi, again),
            out_bitwise=_bitwise(out, ref_out),
            grads_bitwise=_bitwise(grads, ref_grads),
            out_max_diff=_max_diff(out, ref_out),
            grad_max_diff=_max_diff(grads, ref_grads),
            dropped=int(np.sum(np.asarray(stacked[4].dropped))),
            invalid=int(np.sum(np.asarray(stacked[4].invalid))),
        )
    train = _train(n, names) if args.train else None
    hep.check_errors()
    report = dict(
        devices=n,
        processes=jax.process_count(),
        single_process=topo.single_process,
        platform=jax.devices()[0].platform,
        levels=names,
        cases=cases,
        train=train,
        fp8_element_bitwise=_fp8_element_bitwise(),
        fp8_every_pattern=_fp8_rows_of_every_pattern(mesh, topo),
        site_states=_site_states(mesh, topo, args),
    )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
