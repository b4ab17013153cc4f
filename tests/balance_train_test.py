"""The main job (`examples/train_moe/`) with --redundant_slots and --rebalance_every (tiny sizes,
8 devices).

Covers: a run that re-places its experts mid-training has the loss curve of the run without
redundant slots (bit for bit before the first re-placement, to float32 summation order after:
rtol 1e-5, the rows of a hot expert are summed on other ranks), recompiles once per changed
placement and reports per-rank load and the replica sync bytes; a run resumed from a checkpoint
saved after a re-placement continues bit for bit like the uninterrupted run; the flags that
cannot be combined fail before a model is built.
"""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
from rich.console import Console
from train_harness import config, replace, tiny, train_moe
from train_harness import train as _train

from jax_hybridep import xdc

TINY = tiny(steps=4, eval_batches=1)
BALANCED = replace(TINY, redundant_slots=1, rebalance_every=2)


pytestmark = pytest.mark.usefixtures("no_backend_override")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("balance_train")
    plain, _ = _train(replace(TINY, output_dir=str(base / "plain")))
    balanced, text = _train(replace(BALANCED, output_dir=str(base / "balanced")))
    return plain, balanced, text, base


def test_rebalancing_keeps_the_loss_curve(runs):
    plain, balanced, text, _ = runs
    events = balanced["rebalances"]
    assert [e["step"] for e in events] == [2]
    assert events[0]["changed"] and events[0]["remote_replicas"] > 0  # a copy really moved
    assert events[0]["predicted_after"] < events[0]["predicted_before"]
    # Weights forward and gradient back of each remote copy: 3 matrices of d_model x d_ff.
    assert events[0]["sync_bytes_per_step"] == 2 * 3 * 32 * 32 * 4 * events[0]["remote_replicas"]
    assert "rebalance (predicted rank imbalance): layer 0" in text
    assert balanced["compiles"] == 2  # the first compile and the changed placement's
    loss = lambda m: [r["loss"] for r in m["train"]]  # noqa: E731
    # Before the first re-placement the redundant slots are empty: the same bits.
    assert loss(balanced)[:2] == loss(plain)[:2]
    np.testing.assert_allclose(loss(balanced), loss(plain), rtol=1e-5)
    np.testing.assert_allclose(
        [r["loss"] for r in balanced["eval"]], [r["loss"] for r in plain["eval"]], rtol=1e-5
    )
    # Per-rank load: 8 ranks, every routed row counted once.
    assert np.shape(balanced["rank_load"]) == (1, 8)
    assert sum(balanced["rank_load"][0]) == TINY.batch * TINY.seq_len * TINY.model.top_k
    assert all(r["rank_imbalance"] >= 1.0 for r in balanced["train"])


def test_resume_after_a_rebalance_continues_identically(runs, monkeypatch):
    _, balanced, _, base = runs
    # The learning-rate schedule spans --steps; the stopped run takes the full run's schedule so
    # that the uninterrupted run is the reference.
    make_optimizer = train_moe.make_optimizer

    def full_schedule(cfg):
        return make_optimizer(replace(cfg, steps=BALANCED.steps))

    monkeypatch.setattr(train_moe, "make_optimizer", full_schedule)
    cfg = replace(BALANCED, steps=3, output_dir=str(base / "resumed"))
    first, _ = _train(cfg)
    assert [e["step"] for e in first["rebalances"]] == [2]  # the checkpoint holds a new placement
    resumed, text = _train(replace(cfg, steps=4, resume=True))
    assert "resumed from step 3" in text

    def untimed(metrics):
        return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in metrics["train"]]

    assert untimed(resumed) == untimed(balanced)  # bit for bit, every step and field
    # The restored state is evaluated again at step 3: the stopped run's final eval.
    assert [r for r in resumed["eval"] if r["step"] != 3] == balanced["eval"]
    assert [r["loss"] for r in resumed["eval"] if r["step"] == 3] == [first["final_eval_loss"]]
    assert resumed["rebalances"] == balanced["rebalances"]
    assert resumed["compiles"] == 1  # restored straight onto the saved placement


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(redundant_slots=-1), "--redundant_slots=-1"),
        (dict(rebalance_every=-2), "--rebalance_every=-2"),
        (
            dict(mesh="dc=2,ep=4", migration=xdc.Migration({"dc": 2}), redundant_slots=1),
            "cannot be combined",
        ),
    ],
)
def test_bad_balance_flags_fail_before_a_model_is_built(changes, message, tmp_path, monkeypatch):
    def no_model(*args, **kwargs):
        raise AssertionError("a model was built before the flags were checked")

    monkeypatch.setattr(train_moe, "MoETransformer", no_model)
    cfg = replace(TINY, output_dir=str(tmp_path / "out"), **changes)
    with pytest.raises(config.FlagError, match=message):
        train_moe.train(cfg, console=Console(file=io.StringIO()))
    assert not os.path.exists(cfg.output_dir)
