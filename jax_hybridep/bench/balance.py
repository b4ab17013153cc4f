"""`python -m jax_hybridep.bench.balance`: the balance table and dispatch measurement of
docs/balance.md.

Per skewed routing (`workloads`: Zipf, DeepSeek-V3-like group-limited) the balancer plans from a
moving average of measured batches; the table gives max/mean per-rank load predicted by the plan
and measured (the mean over `HELD_OUT` batches) routed by the real replica rule
(`Replicas.physical_ids`), for plain EP and for the plan. `dispatch_counts` then runs the real
`dispatch` on the first held-out batch: rows dropped with a capacity factor and, dropless, the
largest per-rank receive count (rows in a rank's expert groups), plain EP against the plan.
Counts only, no timings: they are deterministic, so any machine gives the same figures.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from jax_hybridep.balance.balancer import moving_average, plan_placement
from jax_hybridep.balance.placement import Placement, imbalance
from jax_hybridep.balance.skews import KINDS, Skew, counts
from jax_hybridep.bench import cli
from jax_hybridep.values import make_parent_dirs

LOAD_DECAY = 0.9
HELD_OUT = range(100, 110)  # seeds of the held-out batches the plans are measured on


def planned(skew: Skew, ranks: int, tokens: int, redundant: int, per_node, measured=range(1, 5)):
    """(plan, the measured batches' counts): the plan from the moving average of `measured`."""
    load, batches = None, []
    for seed in measured:
        batch = counts(skew.sample(ranks * tokens, seed), skew.num_experts)
        batches.append(batch)
        load = moving_average(load, batch, LOAD_DECAY)
    plan = plan_placement(load, ranks, skew.num_experts // ranks, redundant, per_node)
    return plan, batches


def _topology(ranks: int, per_node):
    import jax  # noqa: PLC0415  (the table's planning part needs no devices)
    from jax.sharding import AxisType  # noqa: PLC0415

    import jax_hybridep as hep  # noqa: PLC0415

    if len(jax.devices()) < ranks:
        raise ValueError(f"the measurement needs {ranks} devices, jax has {len(jax.devices())}")
    shape, names = (
        ((ranks,), ("ep",))
        if per_node is None
        else ((ranks // per_node, per_node), ("node", "local"))
    )
    grid = np.asarray(jax.devices()[:ranks]).reshape(shape)
    mesh = jax.sharding.Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))
    return mesh, hep.Topology.from_mesh(mesh, names)


def measured_rank_load(placement: Placement, idx, per_node) -> np.ndarray:
    """[R] rows each rank receives for `idx` [R, T, K] (source rank major) by the replica rule."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from jax_hybridep.balance.runtime import Replicas  # noqa: PLC0415

    r = placement.num_ranks
    rep = Replicas(placement, _topology(r, per_node)[1])
    phys = jax.jit(jax.vmap(rep.physical_ids))(jnp.asarray(idx), jnp.arange(r))
    return counts(phys, placement.num_slots).reshape(r, -1).sum(1)


def dispatch_counts(placement: Placement | None, idx, per_node, capacity_factor, num_experts):
    """(dropped rows, largest per-rank receive count) of the real `dispatch` of `idx` [R, T, K]
    on R devices (ffi backend); `placement` None is plain EP."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415

    import jax_hybridep as hep  # noqa: PLC0415
    from jax_hybridep.balance.runtime import Replicas  # noqa: PLC0415

    r, t, k = np.shape(idx)
    mesh, topo = _topology(r, per_node)
    cfg = hep.DispatchConfig(
        num_experts=num_experts, capacity_factor=capacity_factor, backend="ffi"
    )
    spec = P(tuple(mesh.axis_names))

    def step(x, ids, w):
        if placement is None:
            d = hep.dispatch(x, ids, w, topology=topo, config=cfg)
        else:
            d = Replicas(placement, topo).dispatch(x, ids, w, config=cfg)
        return d.stats.dropped[None], jnp.sum(d.group_sizes)[None]

    x = jnp.ones((r * t, 8), jnp.float32)
    w = jnp.ones((r * t, k), jnp.float32)
    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec, spec)))
    dropped, received = f(x, jnp.asarray(idx).reshape(r * t, k), w)
    return int(np.sum(dropped)), int(np.max(received))


def table_row(
    kind,
    experts,
    top_k,
    ranks,
    tokens,
    redundant,
    per_node,
    strength=1.0,
    capacity_factor=1.0,
    dispatch=True,
) -> dict:
    """One row of docs/balance.md's table (see the module docstring)."""
    skew = Skew.make(kind, experts, top_k, strength, seed=0)
    plan, batches = planned(skew, ranks, tokens, redundant, per_node)
    held_out = [
        skew.sample(ranks * tokens, seed).reshape(ranks, tokens, top_k) for seed in HELD_OUT
    ]
    plain = Placement.default(experts, ranks, redundant, per_node)

    def measured(placement):
        return float(
            np.mean([imbalance(measured_rank_load(placement, b, per_node)) for b in held_out])
        )

    row = dict(
        kind=kind,
        experts=experts,
        top_k=top_k,
        ranks=ranks,
        slots=f"{experts // ranks}+{redundant}",
        ranks_per_node=per_node,
        tokens_per_rank=tokens,
        hottest_over_mean=float(min(b.max() / b.mean() for b in batches)),
        hottest_share=float(max(b.max() / b.sum() for b in batches)),
        predicted_plain=plan.before,
        predicted_plan=plan.after,
        measured_plain=measured(plain),
        measured_plan=measured(plan.placement),
        copies=int(np.sum(plan.placement.table[:, plan.placement.slots_per_rank :] >= 0)),
        remote_replicas=plan.placement.remote_replicas,
    )
    if dispatch:
        for name, p in (("plain", None), ("plan", plan.placement)):
            drop, _ = dispatch_counts(p, held_out[0], per_node, capacity_factor, experts)
            _, most = dispatch_counts(p, held_out[0], per_node, None, experts)
            row[f"dropped_{name}"] = drop
            row[f"max_received_{name}"] = most
        row["capacity_factor"] = capacity_factor
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m jax_hybridep.bench.balance", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--tokens", type=cli.positive_int, default=512, help="tokens per rank per batch"
    )
    parser.add_argument("--capacity_factor", type=cli.positive_float, default=1.0)
    parser.add_argument("--json", type=cli.output_path, default="", help="also write the rows here")
    args = parser.parse_args(argv)
    import jax  # noqa: PLC0415

    jax.config.update("jax_num_cpu_devices", 8)
    rows = [
        table_row(kind, 64, 8, 8, args.tokens, 1, per_node, capacity_factor=args.capacity_factor)
        for kind in KINDS
        for per_node in (None, 4)
    ]
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        cells = [f"{v:.3f}" if isinstance(v, float) else str(v) for v in row.values()]
        print("| " + " | ".join(cells) + " |")
    if args.json:
        make_parent_dirs(args.json)
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
