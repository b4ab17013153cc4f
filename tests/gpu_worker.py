"""Worker of tests/gpu_jax_test.py: dispatch/combine through the CUDA handlers on real GPUs.

Run as `JAX_PLATFORMS=cuda python tests/gpu_worker.py --devices N` (one process driving N local
GPUs as one EP group). For float32 and bfloat16, dropless and a capacity, weighted and unweighted
combine, it runs the MoE block of tests/harness.py on the ffi backend (CUDA handlers) and on the
xla backend, values and gradients, and twice on ffi (the registered windows are reused). Prints
one JSON line: per case, whether dispatch outputs are bitwise equal, the largest relative
combine/gradient difference, whether those are bitwise, and whether the program ran the CUDA
handlers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from harness import make_mesh, moe_fn, random_routing  # noqa: E402

import jax_hybridep as hep  # noqa: E402


def _run(mesh, topo, backend, dtype, capacity, weighted, args):
    E = args.experts_per_gpu * mesh.size
    cfg = hep.DispatchConfig(num_experts=E, capacity_factor=capacity, backend=backend)
    fn = moe_fn(mesh, topo, cfg, weighted_combine=weighted)
    x, idx, w, experts = args.inputs(E, dtype)

    def loss(x, w):
        return jnp.sum(fn(x, idx, w, experts)[0].astype(jnp.float32) ** 2)

    out, stacked = fn(x, idx, w, experts)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    hlo = fn.lower(x, idx, w, experts).as_text()
    return jax.device_get((out, stacked, grads)), "jax_hybridep_cuda_dispatch" in hlo


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


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--experts_per_gpu", type=int, default=4)
    p.add_argument("--k", type=int, default=4)
    args = p.parse_args()
    n = args.devices
    mesh = make_mesh((n,), ("ep",))
    topo = hep.Topology.from_mesh(mesh, ("ep",))
    rng = np.random.default_rng(0)

    def inputs(E, dtype):
        idx, w = random_routing(rng, n * args.tokens, min(args.k, E), E, invalid_fraction=0.05)
        x = rng.standard_normal((n * args.tokens, args.hidden)).astype(np.float32)
        experts = rng.standard_normal((E, args.hidden, args.hidden)).astype(np.float32) * 0.05
        return jnp.asarray(x, dtype), jnp.asarray(idx), jnp.asarray(w), jnp.asarray(experts, dtype)

    args.inputs = inputs
    cases = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        for capacity in (None, 1.0):
            for weighted in (True, False):
                name = f"{jnp.dtype(dtype).name}_cap{capacity}_weighted{weighted}"
                state = rng.bit_generator.state
                ffi, ran_cuda = _run(mesh, topo, "ffi", dtype, capacity, weighted, args)
                rng.bit_generator.state = state
                again, _ = _run(mesh, topo, "ffi", dtype, capacity, weighted, args)
                rng.bit_generator.state = state
                ref, _ = _run(mesh, topo, "xla", dtype, capacity, weighted, args)
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
    hep.check_errors()
    print(json.dumps(dict(devices=n, platform=jax.devices()[0].platform, cases=cases)))


if __name__ == "__main__":
    main()
