"""scripts/gpu_check.sh's logic without a GPU (`--dry-run`: every step's command echoed, not run).

A lease is 15 minutes and may be the only one: the script must run its steps in the order the
measurements are owed in (docs/gpu.md), write each step's JSON as it ends, pack what finished,
keep the transport's figures when its tests fail (and then never time it at the JAX level), and
skip what no longer fits its time budget.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tarfile

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.sh"
ORDER = ["build", "csm", "transport", "kernels", "jax", "bench", "memcheck"]


def _dry_run(tmp_path, **env) -> tuple[int, list[dict], str]:
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"],
        env=dict(
            os.environ,
            PYTHON=sys.executable,
            OUT=str(out),
            GPU_CHECK_LOGS=str(tmp_path / "logs"),
            **env,
        ),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    steps = json.loads((out / "steps.json").read_text())
    with tarfile.open(out / "gpu_check.tgz") as tgz:
        assert "./summary.txt" in tgz.getnames()
    return proc.returncode, steps, proc.stdout


def test_steps_run_in_order_each_writing_its_json(tmp_path):
    rc, steps, stdout = _dry_run(tmp_path)
    assert rc == 0, stdout[-3000:]
    assert [s["step"] for s in steps] == ORDER
    assert all(s["status"].startswith("ok") for s in steps)
    assert "--backends ffi,xla" in stdout


def test_figures_come_when_the_kernels_fail_to_verify(tmp_path):
    rc, steps, stdout = _dry_run(tmp_path, DRY_RUN_FAIL="kernels")
    assert rc == 1
    status = {s["step"]: s["status"] for s in steps}
    assert status["kernels"].startswith("FAILED")
    assert status["csm"].startswith("ok") and status["transport"].startswith("ok")
    assert status["memcheck"].startswith("ok")
    assert "bench" not in status  # a transport that did not verify is never timed
    assert "bench         skipped (the transport did not verify)" in stdout


def test_steps_past_the_budget_are_skipped(tmp_path):
    _, steps, _ = _dry_run(tmp_path, DEADLINE_S="20")
    assert {s["status"] for s in steps} == {"skipped (out of time)"}
