"""Benchmark metrics: per-case rows, the floor, algorithm bandwidth and fair ratios.

* Algorithm bandwidth (Hybrid-EP's definition): received unique tokens x H x dtype bytes / time,
  where received unique tokens = (token, destination rank) pairs, self included, from the routing
  (before drops, so every method of a routing gets the same numerator). A timed dispatch + combine
  moves those bytes once each way, so it counts them twice (the harmonic mean of the per-op
  bandwidths); forward + backward counts them four times.
* Level bytes: payload one direction (dispatch; combine sends the same back), all ranks summed,
  self excluded. hybridep: `stats.level_rows` measured in the run ("ep" for flat, "node"/"local"
  for hierarchical) plus, for flat, the node/local split counted in numpy from the routing.
  Dense baselines: their whole padded buffers ((R - L) / R of each rank's buffer crosses nodes,
  (L - 1) / R stays inside); MaxText with real ragged_all_to_all: its ×top-k expanded rows.
* Sent bytes (hybridep): what the route's levels put on the links one direction, all ranks
  summed, as each level sends (`jax_hybridep.level_traffic`, `level_sends` per level): a padded
  level (S - 1) * M slots per rank whatever the routing, a ragged one its real copies' slots
  plus the counts' all-gather, slots being payload plus 12 K bytes of metadata; host levels and
  spanning bottoms their copies' payload.
* Fair ratios: `ratio_to_best_baseline` = the best baseline's median / this case's median (> 1 is
  faster) within the same routing, direction and capacity setting: dropless against the dropless
  baselines (worst-case buffers, MaxText worst-case factor), capacity f against GShard at the same
  f. A `budget=F` case (dropless with the opt-in `row_budget = ceil(F * T * K)` rows per rank)
  is compared with the dropless baselines; rows over its budget are dropped and counted in
  `dropped`. `ratio_to_floor` = median / floor median (>= 1; how far from one copy of the
  bytes).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jax_hybridep import level_traffic, traffic
from jax_hybridep.bench import baselines


def _itemsize(preset) -> int:
    return jnp.dtype(preset.dtype).itemsize


def passes(direction: str) -> int:
    return 2 if direction == "fwd" else 4


def case_row(
    case,
    direction,
    wl,
    preset,
    *,
    nodes,
    median,
    times,
    dropped,
    level_rows,
    axes,
    recv_rows,
    route=None,
    topology=None,
    memory,
    err,
    compile_s,
) -> dict:
    h, b = preset.hidden, _itemsize(preset)
    ranks, t, k = wl.ranks, wl.tokens, preset.top_k
    received = wl.received_tokens()
    per_node = ranks // nodes
    per_rank = np.asarray(level_rows)  # [ranks, levels]
    level_rows = per_rank.sum(0)
    sends, sent = None, None
    if case.method == "hybridep":
        copy = traffic.copy_bytes(h, preset.dtype, case.wire_dtype)  # a copy on the wire
        level = {str(name): int(r) * copy for name, r in zip(axes, level_rows, strict=True)}
        if route is not None:
            sends = level_traffic.route_sends(route)
            counted = level_traffic.sent_bytes(
                topology,
                sends,
                per_rank,
                tokens=t,
                hidden=h,
                dtype=preset.dtype,
                k=k,
                rows=recv_rows,
                wire_dtype=case.wire_dtype,
            )
            sent = {str(n): int(v) for n, v in zip(axes, counted.sum(0), strict=True)}
        if case.topology == "flat":
            level.update({n: c * copy for n, c in wl.flat_copies(nodes).items()})
        buf_rows = recv_rows
    else:
        ragged = case.backend == "ragged"
        send = baselines.buffer_rows(
            case.method,
            tokens=t,
            top_k=k,
            experts=wl.experts,
            ranks=ranks,
            capacity_factor=case.capacity_factor,
            ragged=ragged,
        )
        if ragged:
            level = {n: c * h * b for n, c in wl.expanded_copies(nodes).items()}
            buf_rows = ranks * t * k
        else:
            per_dest = send // ranks
            level = {
                "node": ranks * (ranks - per_node) * per_dest * h * b,
                "local": ranks * (per_node - 1) * per_dest * h * b,
            }
            buf_rows = send
    return {
        "method": case.method,
        "backend": case.backend,
        "label": case.label,
        "topology": case.topology,
        "routing": wl.routing,
        "capacity": case.capacity,
        "variant": case.variant if case.method == "hybridep" else None,
        "zero_padding": case.zero_padding if case.method == "hybridep" else None,
        "wire_dtype": case.wire_dtype if case.method == "hybridep" else None,
        "capacity_factor": case.capacity_factor,
        "row_budget_factor": None if case.budget is None else case.budget.factor,
        "baseline_capacity": case.baseline_capacity,
        "direction": direction,
        "median_s": median,
        "times_s": times,
        "compile_s": compile_s,
        "received_tokens": received,
        "algo_bw_GBps": passes(direction) * received * h * b / median / 1e9,
        "level_bytes": level,
        "level_sends": None if sends is None else dict(zip(map(str, axes), sends, strict=True)),
        "sent_bytes": sent,
        "buffer_bytes": int(buf_rows) * h * b,
        "xla_memory_bytes": memory,
        "dropped": int(dropped),
        "max_rel_err": err,
    }


def floor_row(wl, preset, direction, n_passes, received, median, times) -> dict:
    moved = n_passes * received * preset.hidden * _itemsize(preset)
    return {
        "routing": wl.routing,
        "direction": direction,
        "rows": received,
        "passes": n_passes,
        "bytes": moved,
        "median_s": median,
        "times_s": times,
        "bw_GBps": moved / median / 1e9,
    }


def add_ratios(cases: list[dict], floors: list[dict]) -> None:
    """Fills ratio_to_best_baseline / best_baseline / ratio_to_floor in place."""
    floor = {(f["routing"], f["direction"]): f["median_s"] for f in floors}
    for row in cases:
        peers = [
            r
            for r in cases
            if r["method"] != "hybridep"
            and (r["routing"], r["direction"], r["capacity"])
            == (row["routing"], row["direction"], row.get("baseline_capacity", row["capacity"]))
        ]
        best = min(peers, key=lambda r: r["median_s"], default=None)
        row["best_baseline"] = None if best is None else best["label"]
        row["ratio_to_best_baseline"] = None if best is None else best["median_s"] / row["median_s"]
        f = floor.get((row["routing"], row["direction"]))
        row["ratio_to_floor"] = None if f is None else row["median_s"] / f


def progress_line(row: dict) -> str:
    return (
        f"{row['routing']:9s} {row['capacity']:9s} {row['direction']:8s} {row['label']:24s} "
        f"{row['median_s'] * 1e3:9.3f} ms  dropped {row['dropped']}"
    )
