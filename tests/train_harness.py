"""Shared setup of the tests that run the example training jobs in-process (the `examples`
package, imported from the repository root; the tiny model they train; one run with its printed
text)."""

from __future__ import annotations

import dataclasses
import io
import os

from rich.console import Console

from examples.cross_dc_job import cross_dc_job  # noqa: F401  (re-exported: the cross-DC job)
from examples.main_job import (  # noqa: F401  (re-exported: the main job and its parts)
    main_job,
    train_checkpoint,
    train_config,
    train_flags,
)

# The folder of the examples' scripts (examples/train_moe.py, examples/cross_dc.py).
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
ROOT = os.path.dirname(EXAMPLES)

# A model that compiles and trains in seconds on 8 fake CPU devices.
TINY = main_job.TrainConfig(
    steps=3,
    batch=8,
    seq_len=32,
    d_model=32,
    d_ff=32,
    layers=1,
    heads=2,
    mesh="ep=8",
    eval_every=2,
    eval_batches=2,
    progress=False,
)


def tiny(**changes) -> main_job.TrainConfig:
    return dataclasses.replace(TINY, **changes)


def train(cfg):
    """Runs main_job.train(cfg); returns (metrics dict, printed text)."""
    out = io.StringIO()
    metrics = main_job.train(cfg, console=Console(file=out, soft_wrap=True))
    return metrics, out.getvalue()


def python_path_env(**changes) -> dict[str, str]:
    """This process's environment with the repository root first on PYTHONPATH (a child
    `python -c` then imports the `examples` package), plus `changes`."""
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path, **changes)
