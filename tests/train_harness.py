"""Shared setup of the tests that run the example training jobs (the `examples` package, imported
from the repository root; the tiny model they train; one run with its printed text; the jobs'
command lines, run from the repository root as README runs them)."""

from __future__ import annotations

import io
import os
import sys

from rich.console import Console

from examples.cross_dc import job as cross_dc  # noqa: F401  (re-exported: the cross-DC job)
from examples.job_runtime.flag_fields import replace
from examples.moe_lm.model import ModelConfig
from examples.train_moe import (  # noqa: F401  (re-exported: the main job's parts)
    checkpoint,
    config,
)
from examples.train_moe import flags as job_flags  # noqa: F401  (absl's own are `flags`)
from examples.train_moe import job as train_moe  # the main job

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The jobs' commands (`python -m examples.<package>`): run them with cwd=ROOT.
TRAIN_MOE = (sys.executable, "-m", "examples.train_moe")
CROSS_DC = (sys.executable, "-m", "examples.cross_dc")

# A model that compiles and trains in seconds on 8 fake CPU devices.
TINY = train_moe.TrainConfig(
    steps=3,
    batch=8,
    seq_len=32,
    model=ModelConfig(d_model=32, d_ff=32, layers=1, heads=2),
    mesh="ep=8",
    eval_every=2,
    eval_batches=2,
    progress=False,
)


def tiny(**changes) -> train_moe.TrainConfig:
    """TINY with `changes`, named as their flags (`flag_fields.replace`: `tiny(heads=4)`)."""
    return replace(TINY, **changes)


def train(cfg):
    """Runs the main job's `train(cfg)`; returns (metrics dict, printed text)."""
    out = io.StringIO()
    metrics = train_moe.train(cfg, console=Console(file=out, soft_wrap=True))
    return metrics, out.getvalue()


def python_path_env(**changes) -> dict[str, str]:
    """This process's environment with the repository root first on PYTHONPATH (a child
    `python -c` then imports the `examples` package), plus `changes`."""
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path, **changes)
