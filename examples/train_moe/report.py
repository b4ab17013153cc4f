"""What the main job reports besides losses: the backend and collectives its compiled
step runs, load imbalance, the balancer's re-placements, and its files: metrics.json and the PNG
of losses and load."""

from __future__ import annotations

import json
import os

import numpy as np

from examples.train_moe.config import flag_values
from jax_hybridep import traffic
from jax_hybridep.xdc.runtime.domains import INNER_SUFFIX


def ran_backend(hlo_text: str) -> str:
    """Which dispatch backend a compiled program runs, read off its custom-call targets."""
    if 'custom_call_target="jax_hybridep_' in hlo_text:
        return "ffi (XLA FFI custom calls jax_hybridep_*)"
    return "xla (jax.lax.all_to_all collectives)"


def program_traffic(hlo_text: str, levels) -> dict[str, dict[str, int]] | None:
    """Per EP level, per collective op: payload bytes one rank receives per step from peers
    across that level in the MoE blocks' own collectives (split levels included), read off the
    compiled step; None where XLA printed replica groups this cannot read."""
    try:
        return {
            level: traffic.crossing_bytes(
                hlo_text, {level, level + INNER_SUFFIX}, op_name="shard_map"
            )
            for level in levels
        }
    except ValueError:
        return None


def imbalance(tokens_per_expert: np.ndarray) -> float:
    """Worst layer's max/mean tokens per expert (1.0 is perfectly balanced); given [layers,
    ranks] rows per rank, the same per rank (what sets the step time)."""
    load = np.asarray(tokens_per_expert, np.float64)
    return float(np.max(load.max(axis=-1) / np.maximum(load.mean(axis=-1), 1e-9)))


def rebalance_line(step: int, events: list[dict]) -> str:
    """One line per re-placement: the predicted imbalance of each block, before -> after."""
    changed = [e for e in events if e["changed"]]
    if not changed:
        return f"step {step:5d}: rebalance: placements kept (no block gains > 2%)"
    parts = [
        f"layer {e['layer']} {e['predicted_before']:.2f} -> {e['predicted_after']:.2f} "
        f"({e['moved_experts']} moved, {e['remote_replicas']} replicas, "
        f"{e['sync_bytes_per_step'] / 1e3:.0f} kB/step sync)"
        for e in changed
    ]
    return f"step {step:5d}: rebalance (predicted rank imbalance): " + "; ".join(parts)


def metrics_of(cfg, history: dict, backend: str, start: int, processes: int) -> dict:
    """The metrics.json of a run (`cfg`, a TrainConfig) from its history so far."""
    return dict(
        config=flag_values(cfg),
        backend=backend,
        start_step=start,
        final_eval_loss=history["eval"][-1]["loss"],
        processes=processes,
        **history,
    )


def write_outputs(output_dir: str, metrics: dict, plot: bool) -> list[str]:
    """Writes metrics.json (whole or not at all: written aside, then renamed) and, with `plot`
    and at least one trained step, train_moe.png; returns the names of the files written."""
    path = os.path.join(output_dir, "metrics.json")
    with open(f"{path}.tmp", "w") as f:
        json.dump(metrics, f, indent=1)
    os.replace(f"{path}.tmp", path)
    written = ["metrics.json"]
    if plot and metrics["train"] and metrics.get("tokens_per_expert"):
        save_plot(
            os.path.join(output_dir, "train_moe.png"),
            metrics["train"],
            metrics["eval"],
            metrics["tokens_per_expert"],
            metrics.get("rank_load"),
        )
        written.append("train_moe.png")
    return written


def save_plot(
    path: str, train: list[dict], evals: list[dict], tokens_per_expert, rank_load=None
) -> None:
    """Loss curves (train and eval) beside the last step's tokens per expert and, given
    [layers, ranks] rows, per EP rank (with redundant slots: where the rows really went)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 2 if rank_load is None else 3
    fig, (ax_loss, ax_load, *ax_rank) = plt.subplots(1, panels, figsize=(5.5 * panels, 4))
    ax_loss.plot([r["step"] for r in train], [r["ce"] for r in train], label="train", lw=0.8)
    ax_loss.plot([r["step"] for r in evals], [r["loss"] for r in evals], "o-", label="eval")
    ax_loss.set(xlabel="step", ylabel="next-byte cross-entropy (nats)", title="loss")
    ax_loss.legend()
    _layer_bars(ax_load, tokens_per_expert, "expert", "tokens (last step)", "expert load")
    for ax in ax_rank:
        _layer_bars(ax, rank_load, "EP rank", "rows received (last step)", "per-rank load")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _layer_bars(ax, per_layer, xlabel: str, ylabel: str, title: str) -> None:
    """One group of bars per x position, one bar per layer."""
    load = np.asarray(per_layer)
    width = 0.8 / len(load)
    for layer, counts in enumerate(load):
        x = np.arange(len(counts)) + (layer - (len(load) - 1) / 2) * width
        ax.bar(x, counts, width, label=f"layer {layer}")
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.legend()
