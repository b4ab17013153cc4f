"""One process of the multi-process tests (started twice by tests/mp_launch.py, not by pytest).

Each process joins `jax.distributed` on 127.0.0.1 with 4 CPU devices; the 8 global devices form
a (node=2, local=4) mesh where "node" is the process index. Cases (`--case`):

* `check`: jit(shard_map(dispatch -> local experts -> combine)) over the whole mesh, forward and
  backward in one compiled step, for a dropless routing with -1 and invalid ids and for a
  capacity routing with drops. Results are gathered to both hosts and compared with the dense
  reference on the same numpy inputs (with the op's `kept` mask) and the §2.1 layout model.
  A ValueError at trace time (an unsupported backend/topology) is reported, not raised.
  `--levels=domains` runs the dropless case with cross-DC expert domains over "node" (S = 2):
  experts are all-gathered across the processes and tokens stay inside each one.
* `dead_peer`: one step runs on both processes, then process 1 dies abruptly (`os._exit`) and
  process 0 keeps stepping; the distributed runtime must end process 0.

The last line printed is a JSON report that the test reads.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

# tests/ is sys.path[0] when this file runs as a script.
from harness import PlanView, local_experts, random_routing, reference_layout  # noqa: E402
from jax.experimental import io_callback, multihost_utils  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_hybridep as hep  # noqa: E402
from jax_hybridep import xdc  # noqa: E402
from jax_hybridep.reference import dense_moe  # noqa: E402

LOCAL_DEVICES = 4
T, H, F, K, E = 6, 8, 4, 3, 16  # per-shard tokens, hidden, expert out, top-k, experts
LEVELS = {"flat": (("node", "local"),), "hier": ("node", "local"), "domains": ("node", "local")}
DOMAINS = {"domains": {"node": 2}}  # per --levels: expert domain sizes (xdc), if any
SEED = 1234
# Seconds without heartbeats after which the coordination service declares a process dead; every
# other process then aborts (SIGABRT) from the runtime's error-polling thread, even while blocked
# in a gloo collective, which by itself waits on a dead peer indefinitely. Measured here: death
# to abort in ~7 s at 10 s, ~13 s at 15 s; the default (100 s) would exceed the tests' 60 s.
HEARTBEAT_TIMEOUT_S = 10


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--process_id", type=int, required=True)
    p.add_argument("--num_processes", type=int, default=2)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--backend", choices=("xla", "ffi", "auto"), default="xla")
    p.add_argument("--levels", choices=tuple(LEVELS), default="flat")
    p.add_argument("--case", choices=("check", "dead_peer"), default="check")
    # dead_peer: process 1 dies before its next step, or inside it between dispatch and combine.
    p.add_argument("--die", choices=("before", "during"), default="during")
    p.add_argument("--heartbeat_timeout_s", type=int, default=HEARTBEAT_TIMEOUT_S)
    return p.parse_args(argv)


def report(**fields):
    print(json.dumps(fields, sort_keys=True), flush=True)


def initialize(args):
    jax.config.update("jax_num_cpu_devices", LOCAL_DEVICES)
    jax.distributed.initialize(
        f"127.0.0.1:{args.port}",
        num_processes=args.num_processes,
        process_id=args.process_id,
        initialization_timeout=60,
        heartbeat_timeout_seconds=args.heartbeat_timeout_s,
        # The shutdown barrier at exit waits for every process; a failed peer must not keep a
        # finished one waiting for the default 5 minutes.
        shutdown_timeout_seconds=30,
    )
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    grid = np.asarray(devices).reshape(args.num_processes, LOCAL_DEVICES)
    for node, row in enumerate(grid):
        assert all(d.process_index == node for d in row), f"mesh row {node}: {row}"
    return jax.sharding.Mesh(grid, ("node", "local"), axis_types=(AxisType.Auto,) * 2)


def problem(num_shards, capacity_case):
    """Deterministic global inputs (same on every process): x, idx, w, experts, cotangent."""
    rng = np.random.default_rng(SEED + capacity_case)
    n = num_shards * T
    idx, w = random_routing(rng, n, K, E, invalid_fraction=0.0 if capacity_case else 0.1)
    if capacity_case:
        idx[: n // 2, 0] = 0  # half the tokens also want expert 0: it overflows its capacity
        idx[n - 3 :, :] = -1  # and some tokens route nowhere
    else:
        idx[::5, 1] = -1
    x = rng.normal(size=(n, H)).astype(np.float32)
    experts = (rng.normal(size=(E, H, F)) / np.sqrt(H)).astype(np.float32)
    cot = rng.normal(size=(n, F)).astype(np.float32)
    return x, idx, w, experts, cot


def global_array(mesh, spec, value):
    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def step_inputs(mesh, topo, x, idx, w, experts, cot):
    """The step's arguments as global arrays: tokens over every mesh axis, experts over EP."""
    spec = P(tuple(mesh.axis_names))
    return (
        global_array(mesh, spec, x),
        global_array(mesh, spec, w),
        global_array(mesh, P(topo.ep_axes), experts),
        global_array(mesh, spec, idx),
        global_array(mesh, spec, cot),
    )


def make_step(mesh, topo, cfg, between=None, domains=None):
    """jit of value_and_grad over the sharded MoE: one compile gives outputs and all gradients.

    `between`, when given, maps the dispatched group sizes to the ones the experts use; it runs
    between dispatch and combine (the dead-peer case kills a process there). `domains`
    (`xdc.ExpertDomains`) gathers the experts inside each domain and dispatches between domains.
    """
    expert_spec = P(topo.ep_axes)
    if domains is not None:
        mesh, topo, cfg = domains.mesh, domains.token_topology, domains.dispatch_config(cfg)
        expert_spec = P(domains.expert_axes)
    spec = P(tuple(mesh.axis_names))

    def per_shard(x, idx, w, experts):
        if domains is not None:
            experts = domains.gather_experts((experts,))[0]
        d = hep.dispatch(x, idx, w, topology=topo, config=cfg)
        group_sizes = d.group_sizes if between is None else between(d.group_sizes)
        y = local_experts(d.tokens, group_sizes, experts)
        out = hep.combine(y, d.handle, weights=d.weights)
        return out, d.kept, d.stats.dropped[None], d.stats.invalid[None]

    moe = jax.shard_map(
        per_shard,
        mesh=mesh,
        in_specs=(spec, spec, spec, expert_spec),
        out_specs=(spec, spec, spec, spec),
    )

    def loss(x, w, experts, idx, cot):
        out, kept, dropped, invalid = moe(x, idx, w, experts)
        return jnp.sum(out * cot), (out, kept, dropped, invalid)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def max_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b) / (1.0 + np.abs(b))))  # relative where large, else absolute


class TraceTimeError(Exception):
    """A ValueError the op raised while tracing: reported to the test rather than a crash."""


def run_case(mesh, topo, backend, capacity_factor, pad_multiple, domains=None):
    """One compiled forward+backward step, gathered and compared on the host."""
    shards = mesh.devices.size
    x, idx, w, experts, cot = problem(shards, capacity_factor is not None)
    cfg = hep.DispatchConfig(
        num_experts=E, capacity_factor=capacity_factor, pad_multiple=pad_multiple, backend=backend
    )
    step = make_step(mesh, topo, cfg, domains=domains)
    args = step_inputs(mesh, topo, x, idx, w, experts, cot)
    try:
        lowered = step.lower(*args)
    except ValueError as e:  # the op refuses this backend/topology, on every process alike
        raise TraceTimeError(str(e)) from e
    ran_ffi = "jax_hybridep_" in lowered.as_text()
    (_, aux), grads = lowered.compile()(*args)
    out, kept, dropped, invalid = multihost_utils.process_allgather(aux, tiled=True)
    g_x, g_w, g_e = multihost_utils.process_allgather(grads, tiled=True)

    # The dense reference on this host alone (one local device, no collectives).
    with jax.default_device(jax.local_devices()[0]):

        def dense_loss(x, w, experts):
            return jnp.sum(dense_moe(x, idx, w, experts, kept=kept) * cot)

        ref_out = dense_moe(x, idx, w, experts, kept=kept)
        ref_grads = jax.grad(dense_loss, argnums=(0, 1, 2))(x, w, experts)

    view = PlanView(E, shards, T, K, capacity_factor=capacity_factor, pad=pad_multiple)
    layout = reference_layout(idx.reshape(shards, T, K), shards, view)
    return dict(
        ran_ffi=ran_ffi,
        err_out=max_err(out, ref_out),
        err_grad_x=max_err(g_x, ref_grads[0]),
        err_grad_weights=max_err(g_w, ref_grads[1]),
        err_grad_experts=max_err(g_e, ref_grads[2]),
        kept_matches_model=bool(np.array_equal(kept.reshape(shards, T, K), layout["row_pos"] >= 0)),
        dropped=int(dropped.sum()),
        dropped_model=int(layout["dropped"].sum()),
        invalid=int(invalid.sum()),
        invalid_model=int(layout["invalid"].sum()),
        no_expert_ids=int((idx == -1).sum()),
    )


def check(args, mesh):
    topo = hep.Topology.from_mesh(mesh, levels=LEVELS[args.levels])
    if args.levels in DOMAINS:
        # Capacity is per replica with domains, so the plain-EP layout model does not apply:
        # the dropless case checks values and gradients against the dense reference.
        domains = xdc.ExpertDomains.from_mesh(mesh, topo, xdc.Migration(DOMAINS[args.levels]))
        case = run_case(mesh, topo, args.backend, None, 1, domains=domains)
        report(status="ok", single_process=topo.single_process, cases={"dropless": case})
        return
    try:
        cases = {
            "dropless": run_case(mesh, topo, args.backend, None, 1),
            "capacity": run_case(mesh, topo, args.backend, 1.0, 2),
        }
    except TraceTimeError as e:
        # Raised before any collective ran, so both processes exit cleanly.
        report(status="raised", error=str(e), single_process=topo.single_process)
        return
    report(status="ok", single_process=topo.single_process, cases=cases)


def dead_peer(args, mesh):
    armed = False

    def maybe_die(group_sizes):
        # Runs on the host, per device, once the dispatch of this step has been exchanged; the
        # combine cannot start before it returns (its rows depend on the result).
        if armed and jax.process_index() == 1:
            print(f"process 1: dying mid-step at {time.time():.3f}", flush=True)
            os._exit(1)  # no atexit, no shutdown barrier, no goodbye to the coordinator
        return group_sizes

    def between(group_sizes):
        shape = jax.ShapeDtypeStruct(group_sizes.shape, group_sizes.dtype)
        return io_callback(maybe_die, shape, group_sizes)

    topo = hep.Topology.from_mesh(mesh, levels=LEVELS[args.levels])
    cfg = hep.DispatchConfig(num_experts=E, backend=args.backend)
    step = make_step(mesh, topo, cfg, between=between)
    inputs = step_inputs(mesh, topo, *problem(mesh.devices.size, False))
    # A first step on both processes: compiled, and the gloo connections between them are open,
    # so the next step blocks on a live peer connection rather than on connection setup.
    jax.block_until_ready(step(*inputs))
    print(f"process {args.process_id}: first step done at {time.time():.3f}", flush=True)
    if args.die == "before" and args.process_id == 1:
        print(f"process 1: dying before the step at {time.time():.3f}", flush=True)
        os._exit(1)
    armed = True
    for i in range(1000):
        jax.block_until_ready(step(*inputs))
        print(f"process {args.process_id}: step {i} done after arming", flush=True)
    report(status="survived")  # the test fails on this: process 0 should not get here


def main(argv=None):
    args = parse_args(argv)
    mesh = initialize(args)
    print(f"process {args.process_id}: initialized at {time.time():.3f}", flush=True)
    if args.case == "check":
        check(args, mesh)
    else:
        dead_peer(args, mesh)


if __name__ == "__main__":
    main()
