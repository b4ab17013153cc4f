"""The errors that end a job with one line naming what is wrong (`run_job.run_job`), raised by
the runtime (the process flags, the output directory) and by the main job (its flags, --resume).
"""

from __future__ import annotations


class FlagError(ValueError):
    """A flag (a TrainConfig field, a process flag) has a value the run cannot use; the message
    names it."""


class ResumeError(ValueError):
    """--resume cannot continue from the checkpoint directory; the message names it and why."""
