"""Benchmark output: the terminal table, the JSON document and the PNG chart."""

from __future__ import annotations

import json
import math

from jax_hybridep.values import make_parent_dirs


def _mb(v) -> str:
    return "-" if v is None else f"{v / 2**20:.1f}"


def _ratio(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


def table(doc: dict) -> str:
    """Cases grouped by routing / capacity / direction, then the floors."""
    width = max([24] + [len(r["label"]) for r in doc["cases"]])
    head = (
        f"{'routing':9s} {'capacity':9s} {'dir':8s} {'method':{width}s} {'median ms':>10s} "
        f"{'algo GB/s':>9s} {'node MB':>8s} {'local MB':>8s} {'ep MB':>7s} {'buf MB':>7s} "
        f"{'dropped':>7s} {'vs best':>8s} {'x floor':>8s}"
    )
    lines = [head, "-" * len(head)]
    key = lambda r: (r["routing"], r["capacity"], r["direction"], r["method"] != "hybridep")  # noqa: E731
    last = None
    for r in sorted(doc["cases"], key=key):
        group = key(r)[:3]
        if last is not None and group != last:
            lines.append("")
        last = group
        lb = r["level_bytes"]
        lines.append(
            f"{r['routing']:9s} {r['capacity']:9s} {r['direction']:8s} {r['label']:{width}s} "
            f"{r['median_s'] * 1e3:10.3f} {r['algo_bw_GBps']:9.3f} {_mb(lb.get('node')):>8s} "
            f"{_mb(lb.get('local')):>8s} {_mb(lb.get('ep')):>7s} {_mb(r['buffer_bytes']):>7s} "
            f"{r['dropped']:7d} {_ratio(r['ratio_to_best_baseline']):>8s} "
            f"{_ratio(r['ratio_to_floor']):>8s}"
        )
    lines += [
        "",
        f"{'floor':9s} {'dir':8s} {'rows':>8s} {'MB':>8s} {'median ms':>10s} {'GB/s':>8s}",
    ]
    for f in doc["floors"]:
        lines.append(
            f"{f['routing']:9s} {f['direction']:8s} {f['rows']:8d} {_mb(f['bytes']):>8s} "
            f"{f['median_s'] * 1e3:10.3f} {f['bw_GBps']:8.3f}"
        )
    lines.append(
        "vs best = best baseline time / this time at the same routing, direction and capacity "
        "(dropless and budget=F vs worst-case/MaxText, f vs GShard f); x floor = time / floor "
        "time; "
        "MB = one direction, all ranks."
    )
    return "\n".join(lines)


def write_json(doc: dict, path: str) -> None:
    def clean(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [clean(x) for x in v]
        return v

    make_parent_dirs(path)
    with open(path, "w") as f:
        json.dump(clean(doc), f, indent=1)


def write_png(doc: dict, path: str) -> None:
    """One panel per direction: median time per (routing, capacity) group, a bar per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directions = sorted({r["direction"] for r in doc["cases"]})
    groups = sorted({(r["routing"], r["capacity"]) for r in doc["cases"]})
    labels = sorted({r["label"] for r in doc["cases"]})
    fig, axes = plt.subplots(
        len(directions),
        1,
        figsize=(max(8, 1.6 * len(groups)), 4.5 * len(directions)),
        squeeze=False,
    )
    width = 0.8 / max(1, len(labels) + 1)
    cmap = plt.get_cmap("tab10")
    floors = {(f["routing"], f["direction"]): f["median_s"] for f in doc["floors"]}
    for ax, direction in zip(axes[:, 0], directions, strict=True):
        for j, label in enumerate(labels):
            xs, ys = [], []
            for i, g in enumerate(groups):
                hit = [
                    r
                    for r in doc["cases"]
                    if (r["routing"], r["capacity"]) == g
                    and r["direction"] == direction
                    and r["label"] == label
                ]
                if hit:
                    xs.append(i + j * width)
                    ys.append(hit[0]["median_s"] * 1e3)
            if xs:
                ax.bar(xs, ys, width, label=label, color=cmap(j % 10))
        for i, g in enumerate(groups):
            f = floors.get((g[0], direction))
            if f is not None:
                ax.hlines(f * 1e3, i - width / 2, i + 0.8, colors="k", linestyles="dashed")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))])
        ax.set_xticklabels([f"{r}\n{c}" for r, c in groups])
        ax.set_yscale("log")
        ax.set_ylabel("median ms (log)")
        ax.set_title(f"dispatch + combine, {direction} (dashed: copy floor)")
        ax.legend(fontsize=7, ncol=2)
    env = doc["environment"]
    fig.suptitle(
        f"jax_hybridep bench: preset {doc['workload']['preset']}, "
        f"{env['num_devices']} x {env['platform']}"
    )
    fig.tight_layout()
    make_parent_dirs(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
