"""examples/cross_dc.py end to end at a tiny size: plan, train planned and plain EP, report."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def test_cross_dc_example_plans_trains_and_reports_bytes_across_the_dc_level(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_HYBRIDEP_BACKEND")}
    out = subprocess.run(
        [sys.executable, "cross_dc.py", "--steps=3", f"--output_dir={tmp_path}"],
        cwd=EXAMPLES,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "bytes across the DC level per rank per step" in out.stdout
    with open(tmp_path / "summary.json") as f:
        summary = json.load(f)
    runs = summary["runs"]
    plain = runs["plain EP"]
    (planned,) = [r for name, r in runs.items() if name != "plain EP"]
    assert planned["domains"][0] == 2  # the slow WAN: experts migrate across the DC pair
    # Plain EP sends tokens and no experts across the DC level; the plan the reverse.
    assert plain["dc_bytes"]["experts"] == 0 < plain["dc_bytes"]["tokens"]
    assert planned["dc_bytes"]["tokens"] == 0
    assert planned["dc_bytes"]["experts"] == planned["predicted_dc_bytes"]
    # Exact runtime: the same losses with and without domains.
    assert math.isclose(plain["train_loss"], planned["train_loss"], rel_tol=1e-5)
