"""The cross-DC job (`python -m examples.cross_dc`) at a tiny size, in-process: plan, train plain
EP, the plan and SR-compressed domains with gradient compression, and the bytes across the DC
level measured (compiled step, first step's copies) equal to the model's prediction from the same
run's routing, dense gradients included; a re-planned run switching domains at a bandwidth drop
trains like plain EP with one more compile; bad flags rejected before any model is built."""

from __future__ import annotations

import dataclasses
import io
import math
import subprocess

import pytest
from rich.console import Console
from train_harness import CROSS_DC, ROOT, cross_dc

from jax_hybridep import xdc

KEYS = ("experts", "all_reduce", "tokens", "total")
# One expert per rank (8 experts, 8 ranks): three 128 x 256 float32 matrices.
EXPERT = 3 * 128 * 256 * 4

pytestmark = pytest.mark.usefixtures("no_backend_override")


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    out = tmp_path_factory.mktemp("cross_dc")
    console = Console(file=io.StringIO(), width=160)
    s = cross_dc.Settings(steps=4, output_dir=str(out))
    base = cross_dc.base_config(s)
    dense, routing = cross_dc.first_step(base)
    summary = cross_dc.run(s, console, first=(dense, routing))
    # SR compression on a DC-level domain, the persistent shared expert refreshed every 2 steps,
    # the gradients compressed too.
    sr = dataclasses.replace(
        s, migration=xdc.Migration({"dc": 2}, 10.0, sync_every=2, grad_compression=10.0)
    )
    compressed = cross_dc.run_one(sr, base, (2, 1, 1), sr.migration, routing, dense, console)
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
    # Two layers' persistent shared experts, each refreshed by an all-reduce of one expert over
    # the 8 ranks (4 across: 2 * 4 / 8 of it) every 2 steps, on top of the dense gradients.
    assert sr["measured"]["all_reduce"] - summary["dense_bytes"] == 2 * EXPERT / 2
    k = math.floor(128 * 256 * 4 / (10.0 * 8))
    # Compressed gather and compressed gradients: k values and k int32 indices per matrix.
    assert sr["measured"]["experts"] == 2 * (3 * k * 8 + 3 * k * 8)
    plain = summary["runs"]["plain EP"]
    assert math.isclose(plain["train_loss"], sr["train_loss"], rel_tol=0.05)


def test_replanning_switches_at_a_bandwidth_drop_and_trains_like_plain_ep(example, tmp_path):
    summary, _, _ = example
    s = cross_dc.Settings(
        steps=4, replan_every=2, link_schedule="2:dc=0.01", output_dir=str(tmp_path)
    )
    console = Console(file=io.StringIO(), width=160)
    out = cross_dc.run(s, console, first=(summary["dense_bytes"], None))
    first, second = out["history"]
    # Planned at 10 Gbps: experts cross the WAN; at 0.01 Gbps tokens do (fewer bytes).
    assert first["changed"] and first["layer_domains"][0][0] == 1 == first["layer_domains"][1][0]
    assert not second["changed"] and first["gbps"]["dc"] == 0.01
    assert first["chosen_s"] < first["current_s"]
    assert out["compiles"] == 2  # one more compile for the one change, none for "no change"
    assert out["programs"][0]["experts"] == 2 * 2 * EXPERT and out["programs"][1]["experts"] == 0
    # The runtime is exact: switching domains mid-run changes no loss.
    plain = summary["runs"]["plain EP"]
    for a, b in zip(plain["train"], out["train"], strict=True):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5)


BAD = [
    (dict(steps=0), "--steps=0"),
    (dict(batch=12), "--batch=12: must be a positive multiple of the 8"),
    (dict(wan_gbps=0.0), "--wan_gbps=0.0"),
    (dict(node_gbps=float("nan")), "--node_gbps=nan"),
    (dict(wan_latency_ms=-1.0), "--wan_latency_ms=-1.0"),
    (dict(migration=xdc.Migration({"rack": 2})), "--domains='rack=2': 'rack' is not a level"),
    (dict(migration=xdc.Migration({"dc": 3})), "dc=3 must divide the level's 2 ranks"),
    (dict(backend="gpu"), "--backend='gpu'"),
    (dict(link_schedule="5:dc=1"), "--replan_every=0: must be set for --link_schedule"),
    (dict(replan_every=5, link_schedule="5:wan=1"), "link_schedule='5:wan=1'"),
    (dict(sr_table=True, replan_every=5), "--sr_table=True: is a mode of its own"),
    (dict(output_dir="/proc/hybridep_out"), "--output_dir=/proc/hybridep_out cannot be created"),
]


@pytest.mark.parametrize("bad,message", BAD, ids=[m for _, m in BAD])
def test_settings_name_the_bad_flag(bad, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        cross_dc.Settings(**bad).check()


def test_cli_rejects_a_bad_flag_before_building_a_model(tmp_path):
    # The cross-DC flags parse into one xdc.Migration (the main job's config.parse_migration).
    message = "--domain_compression=1.0 must be a finite number > 1"
    out = subprocess.run(
        [*CROSS_DC, "--domain_compression=1.0", f"--output_dir={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]  # one line, the last
    assert last == f"cross_dc: {message} (a compression ratio; leave it unset for none)"
    assert not any(tmp_path.iterdir())  # nothing trained, nothing written
