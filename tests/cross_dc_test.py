"""examples/cross_dc.py at a tiny size, in-process: plan, train plain EP, the plan and SR-compressed
domains, and the bytes across the DC level measured (compiled step, first step's copies) equal to
the model's prediction from the same run's routing, dense gradients included; bad flags rejected
before any model is built."""

from __future__ import annotations

import dataclasses
import io
import math
import os
import subprocess
import sys

import pytest
from rich.console import Console

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
sys.path.insert(0, EXAMPLES)

import cross_dc  # noqa: E402

KEYS = ("experts", "all_reduce", "tokens", "total")
# One expert per rank (8 experts, 8 ranks): three 128 x 256 float32 matrices.
EXPERT = 3 * 128 * 256 * 4


@pytest.fixture(autouse=True)
def _no_backend_override(monkeypatch):
    monkeypatch.delenv("JAX_HYBRIDEP_BACKEND", raising=False)


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    out = tmp_path_factory.mktemp("cross_dc")
    console = Console(file=io.StringIO(), width=160)
    s = cross_dc.Settings(steps=2, output_dir=str(out))
    base = cross_dc.base_config(s)
    dense, routing = cross_dc.first_step(base)
    summary = cross_dc.run(s, console, first=(dense, routing))
    # SR compression on a DC-level domain (the plan with compression keeps plain EP: at S = 2 the
    # shared expert's sync costs what the compressed gather saves).
    sr = dataclasses.replace(s, domains="dc=2", domain_compression=10.0)
    compressed = cross_dc.run_one(sr, base, (2, 1, 1), 10.0, routing, dense, console)
    return summary, compressed, console.file.getvalue()


def _assert_measured_is_predicted(run):
    for key in KEYS:
        assert run["measured"][key] == pytest.approx(run["predicted"][key], rel=1e-12), key


def test_plain_ep_and_plan_measured_equal_predicted_dense_included(example):
    summary, _, text = example
    assert "bytes across the DC level per rank per step" in text
    plain = summary["runs"]["plain EP"]
    (planned,) = [r for name, r in summary["runs"].items() if name != "plain EP"]
    assert planned["domains"][0] == 2  # the slow WAN: experts migrate across the DC pair
    dense = summary["dense_bytes"]
    assert dense > 0
    for run in (plain, planned):
        _assert_measured_is_predicted(run)
        # Without compression the only all-reduce across the DC level is the dense gradients'
        # (8 ranks, 4 across: 2 * 4 / 8 of the bytes).
        assert run["measured"]["all_reduce"] == run["predicted"]["dense"] == dense
    # Plain EP sends tokens and no experts across the DC level; the plan the reverse.
    assert plain["measured"]["experts"] == 0 < plain["measured"]["tokens"]
    assert planned["measured"]["tokens"] == 0
    assert planned["measured"]["experts"] == 2 * 2 * EXPERT  # 2 layers, gather + reduce-scatter
    # Exact runtime: the same losses with and without domains.
    assert math.isclose(plain["train_loss"], planned["train_loss"], rel_tol=1e-5)


def test_compressed_domains_measured_equal_predicted(example):
    summary, sr, _ = example
    _assert_measured_is_predicted(sr)
    assert sr["compression"] == 10.0
    # Two layers' shared-expert syncs (one expert each, S = 2) on top of the dense gradients:
    # with 2 layers XLA combines the six matrices' all-reduces into one tuple.
    assert sr["measured"]["all_reduce"] - summary["dense_bytes"] == 2 * EXPERT
    k = math.floor(128 * 256 * 4 / (10.0 * 8))
    assert sr["measured"]["experts"] == 2 * (3 * k * 8 + EXPERT)  # compressed gather, full RS
    plain = summary["runs"]["plain EP"]
    assert math.isclose(plain["train_loss"], sr["train_loss"], rel_tol=0.05)


BAD = [
    (dict(steps=0), "--steps=0"),
    (dict(batch=12), "--batch=12: must be a positive multiple of the 8"),
    (dict(wan_gbps=0.0), "--wan_gbps=0.0"),
    (dict(node_gbps=float("nan")), "--node_gbps=nan"),
    (dict(wan_latency_ms=-1.0), "--wan_latency_ms=-1.0"),
    (dict(domain_compression=1.0), "--domain_compression=1.0: must be > 1"),
    (dict(domains="rack=2"), "--domains='rack=2'"),
    (dict(domains="dc=3"), "dc=3 must divide the level's 2 ranks"),
    (dict(backend="gpu"), "--backend='gpu'"),
]


@pytest.mark.parametrize("bad,message", BAD, ids=[m for _, m in BAD])
def test_settings_name_the_bad_flag(bad, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        cross_dc.Settings(**bad).check()


def test_cli_rejects_a_bad_flag_before_building_a_model(tmp_path):
    out = subprocess.run(
        [sys.executable, "cross_dc.py", "--batch=12", f"--output_dir={tmp_path}"],
        cwd=EXAMPLES,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode != 0
    assert "--batch=12: must be a positive multiple" in out.stderr + out.stdout
    assert not any(tmp_path.iterdir())  # nothing trained, nothing written
