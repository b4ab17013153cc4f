"""Bytes per level and buffer memory, padded vs ragged levels: `python -m jax_hybridep.bench.bytes`.

Counts, not timings: for each EP topology and routing it draws the benchmark's routing
(`workloads.topk_ids`: uniform, or DeepSeek-V3's group-limited top-k through
`jax_hybridep.nn.route`) from seeded router logits, one rank's tokens at a time (no payload is
made, so EP = 64 at T = 4096 and H = 7168 takes seconds), counts each rank's copies per level
from it (`level_traffic.level_copies`, exactly what `stats.level_rows` reports at run time) and
prints, per level, the bytes a rank sends to other ranks through padded levels (`XlaLevel`, the
CPU's `xla` route) and ragged ones (`RaggedLevel`, the `xla` route on GPUs and TPUs), and each
rank's largest receive buffer and its peak of level buffers (held items, send and receive
buffer of one level) dropless and with a capacity (`level_traffic`; the slot of each is payload
plus 12 K bytes of metadata). Every expert on rank e // L (the default placement), dropless.
"""

from __future__ import annotations

import argparse

import numpy as np

from jax_hybridep import config as hep_config
from jax_hybridep import level_traffic
from jax_hybridep.bench import cli
from jax_hybridep.bench.workloads import ROUTINGS, topk_ids
from jax_hybridep.topology import Topology

LOCAL_EXPERTS = 8  # the hybridep preset's experts per rank


def topology(spec: str) -> Topology:
    """'64' -> one level of 64 ranks; '8x8' -> (node=8, local=8)."""
    sizes = [int(s) for s in spec.split("x")]
    names = ("ep",) if len(sizes) == 1 else ("node", "local", "dc")[: len(sizes)]
    return Topology(levels=tuple((n,) for n in names), mesh_axes=names, mesh_shape=sizes)


def routing_dest(topo: Topology, routing: str, tokens: int, top_k: int, seed: int) -> np.ndarray:
    """[R, T, K] destination EP rank of every (source rank, t, k). DeepSeek's expert groups: one
    per EP rank on one level (the benchmark's), one per node (the slowest level's members) on
    several, as V3 groups its experts by node."""
    ranks = topo.ep_size
    groups = ranks if len(topo.levels) == 1 else topo.level_sizes[0]
    rng = np.random.default_rng(seed)
    experts = LOCAL_EXPERTS * ranks
    dest = np.empty((ranks, tokens, top_k), np.int64)
    for r in range(ranks):
        logits = rng.standard_normal((tokens, experts)).astype(np.float32)
        dest[r] = topk_ids(routing, logits, top_k, groups) // LOCAL_EXPERTS
    return dest


def plan_rows(topo: Topology, tokens: int, top_k: int, capacity_factor) -> int:
    """C, as `config.make_plan` derives it."""
    cfg = hep_config.DispatchConfig(
        num_experts=LOCAL_EXPERTS * topo.ep_size, capacity_factor=capacity_factor
    )
    return hep_config.make_plan(topo, cfg, tokens, top_k).rows


def buffers(topo: Topology, sends, tokens: int, top_k: int, rows: int, slot: int):
    """(largest receive buffer, peak of one level's held + send + receive buffers), bytes."""
    held, largest, peak = tokens, 0, 0
    for send, recv in level_traffic.buffer_slots(topo, sends, tokens, top_k, rows):
        largest, peak = max(largest, recv), max(peak, held + send + recv)
        held = recv
    return largest * slot, peak * slot


def rows_of_table(args) -> list[list[str]]:
    out = []
    for spec in args.topologies:
        topo = topology(spec)
        levels = len(topo.levels)
        padded, ragged = ("padded",) * levels, ("ragged",) * levels
        slot = level_traffic.slot_bytes(args.hidden, "bfloat16", args.top_k)
        memory = {}
        for f in (None, args.capacity_factor):
            rows = plan_rows(topo, args.tokens, args.top_k, f)
            memory[f] = [
                buffers(topo, s, args.tokens, args.top_k, rows, slot) for s in (padded, ragged)
            ]
        for routing in args.routings:
            dest = routing_dest(topo, routing, args.tokens, args.top_k, args.seed)
            copies = level_traffic.level_copies(dest, topo)
            rows = plan_rows(topo, args.tokens, args.top_k, None)
            kw = dict(tokens=args.tokens, hidden=args.hidden, dtype="bfloat16", k=args.top_k)
            pad = level_traffic.sent_bytes(topo, padded, copies, rows=rows, **kw)
            rag = level_traffic.sent_bytes(topo, ragged, copies, rows=rows, **kw)
            for level, name in enumerate(n for (n,) in topo.levels):
                p, r = pad[:, level], rag[:, level]
                out.append(
                    [
                        spec
                        if levels == 1
                        else f"node={topo.level_sizes[0]}, local={topo.level_sizes[1]}",
                        routing,
                        name,
                        f"{p.mean() / 1e6:.0f}",
                        f"{r.mean() / 1e6:.1f} ({r.max() / 1e6:.1f})",
                        f"{p.mean() / r.mean():.2f}x" if r.mean() else "-",
                        f"{copies[:, level].mean() / args.tokens:.2f}",
                    ]
                    + (
                        [_memory(memory[None]), _memory(memory[args.capacity_factor])]
                        if level == 0
                        else ["", ""]
                    )
                )
    return out


def _memory(pair) -> str:
    (p_recv, p_peak), (r_recv, r_peak) = pair
    return f"{p_recv / 1e9:.2f} / {r_recv / 1e9:.2f} (peak {p_peak / 1e9:.2f} / {r_peak / 1e9:.2f})"


def table(args) -> str:
    head = [
        "EP",
        "routing",
        "level",
        "padded MB/rank",
        "ragged MB/rank mean (max)",
        "padded / ragged",
        "copies / T",
        "receive GB dropless, padded / ragged (peak)",
        f"receive GB f={args.capacity_factor:g}, padded / ragged (peak)",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows_of_table(args)]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jax_hybridep.bench.bytes", description=__doc__)
    p.add_argument("--topologies", type=lambda s: s.split(","), default=["8", "16", "64", "8x8"])
    p.add_argument("--routings", type=cli.choice_list(ROUTINGS), default=["uniform", "deepseek"])
    p.add_argument("--tokens", type=cli.positive_int, default=4096, help="T per rank")
    p.add_argument("--hidden", type=cli.positive_int, default=7168)
    p.add_argument("--top_k", type=cli.positive_int, default=8)
    p.add_argument("--capacity_factor", type=cli.positive_float, default=1.25)
    p.add_argument("--seed", type=cli.nonnegative_int, default=0)
    return p


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    for spec in args.topologies:
        try:
            topology(spec)
        except ValueError:
            parser().error(f"--topologies: {spec!r} is not N or NxM")
    print(table(args))


if __name__ == "__main__":
    main()
