"""CUDA IPC at the kernel layer: two processes, one rank each, on the one GPU (docs/design.md §5).

Each process (tests/cuda_ipc_worker.py) registers a multi-process window, swaps CUDA IPC handles
with the other through files (the jax.distributed store's stand-in), and runs the transport's
per-rank launchers against the peer's window opened by IPC; both must reproduce the numpy model
bit for bit. Skips without a GPU; fails instead when JAX_HYBRIDEP_REQUIRE_GPU=1.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

WORKER = pathlib.Path(__file__).with_name("cuda_ipc_worker.py")


def _exclusive_compute_mode() -> bool:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    out = subprocess.run([smi, "--query-gpu=compute_mode", "--format=csv,noheader"],
                         capture_output=True, text=True, check=False).stdout  # fmt: skip
    return "Exclusive" in out


@pytest.mark.gpu
def test_two_processes_one_gpu(gpu, tmp_path):
    if _exclusive_compute_mode():
        pytest.skip("the GPU is in an exclusive compute mode: two processes cannot share it")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    procs = []
    for r, log in enumerate(logs):
        # Files, not pipes: a full pipe would stall a worker. The report is stdout's last line.
        with open(log, "w") as out, open(log.with_suffix(".err"), "w") as err:
            procs.append(subprocess.Popen(
                [sys.executable, str(WORKER), f"--rank={r}", "--ranks=2", f"--dir={tmp_path}"],
                env=env, stdout=out, stderr=err, text=True,
            ))  # fmt: skip
    try:
        for proc in procs:
            proc.wait(timeout=240)
    finally:
        for proc in procs:
            proc.kill()
    outputs = [log.read_text() for log in logs]
    errors = [log.with_suffix(".err").read_text() for log in logs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(e[-3000:] for e in errors)
    results = [json.loads(o.strip().splitlines()[-1]) for o in outputs]
    assert [r["rank"] for r in results] == [0, 1]
    assert results[0]["pid"] != results[1]["pid"]
    for result in results:
        assert result["mismatches"] == [], result
