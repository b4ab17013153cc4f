"""Shared setup of the tests that run the example training jobs in-process (examples/ on
sys.path, the tiny model they train, one run with its printed text)."""

from __future__ import annotations

import dataclasses
import io
import os
import sys

from rich.console import Console

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
sys.path.insert(0, EXAMPLES)

import cross_dc  # noqa: E402, F401  (re-exported: the cross-DC example)
import train_checkpoint  # noqa: E402, F401  (re-exported: the checkpoint's reader)
import train_config  # noqa: E402, F401  (re-exported: the flags' checks)
import train_flags  # noqa: E402, F401  (re-exported: the command line)
import train_moe  # noqa: E402

# A model that compiles and trains in seconds on 8 fake CPU devices.
TINY = train_moe.TrainConfig(
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


def tiny(**changes) -> train_moe.TrainConfig:
    return dataclasses.replace(TINY, **changes)


def train(cfg):
    """Runs train_moe.train(cfg); returns (metrics dict, printed text)."""
    out = io.StringIO()
    metrics = train_moe.train(cfg, console=Console(file=out, soft_wrap=True))
    return metrics, out.getvalue()
