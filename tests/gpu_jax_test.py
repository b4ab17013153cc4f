"""JAX-level dispatch/combine on real GPUs through the CUDA handlers (tests/gpu_worker.py).

The worker runs in its own process with JAX_PLATFORMS=cuda (this suite's process is pinned to fake
CPU devices): one process driving one GPU (`gpu`) or every local GPU as one EP group
(`multigpu`). Dispatch outputs must equal the xla backend's bit for bit; combine and gradients
must agree to float32 rounding (XLA:GPU may contract the xla backend's multiply-adds, which the
CUDA kernels never do) and be bitwise reproducible from run to run on reused windows. Skips
without a GPU; fails instead when JAX_HYBRIDEP_REQUIRE_GPU=1.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from jax_hybridep import _native

WORKER = pathlib.Path(__file__).with_name("gpu_worker.py")
TIMEOUT_S = 300


def _run_worker(devices: int) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cuda", XLA_PYTHON_CLIENT_MEM_FRACTION="0.5")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [sys.executable, str(WORKER), f"--devices={devices}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check(result: dict, devices: int):
    assert result["devices"] == devices and result["platform"] == "gpu"
    for name, case in result["cases"].items():
        assert case["ran_cuda"], name
        assert case["dispatch_bitwise"], (name, case)
        assert case["rerun_bitwise"], (name, case)
        tol = 1e-5 if name.startswith("float32") else 2e-2  # relative to the largest value
        assert case["out_max_diff"] <= tol, (name, case)
        assert case["grad_max_diff"] <= tol, (name, case)
    assert any(c["invalid"] > 0 for c in result["cases"].values())


@pytest.mark.gpu
def test_one_gpu(gpu):
    _check(_run_worker(1), 1)


@pytest.mark.gpu
@pytest.mark.multigpu
def test_all_local_gpus_one_process(gpu):
    count = _native.module().cuda_device_count()
    if count < 2:
        pytest.skip(f"{count} GPU visible; this test needs at least 2")
    _check(_run_worker(count), count)
