"""CUDA IPC at the kernel layer: two processes, one rank each, on the one GPU (DESIGN §5).

Each process (tests/cuda_ipc_worker.py) registers a multi-process window, swaps CUDA IPC handles
with the other through files (the jax.distributed store's stand-in), and runs the transport's
per-rank launchers against the peer's window opened by IPC; both must reproduce the numpy model
bit for bit. Skips without a GPU; fails instead when JAX_HYBRIDEP_REQUIRE_GPU=1.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

WORKER = pathlib.Path(__file__).with_name("cuda_ipc_worker.py")


@pytest.mark.gpu
def test_two_processes_one_gpu(gpu, tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), f"--rank={r}", "--ranks=2", f"--dir={tmp_path}"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for r in range(2)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err[-4000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert [r["rank"] for r in results] == [0, 1]
    assert results[0]["pid"] != results[1]["pid"]
    for result in results:
        assert result["mismatches"] == [], result
