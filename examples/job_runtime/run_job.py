"""The command-line job around a job's body (the main job's `train`, the cross-DC job's runs):
SIGTERM taken, the processes started and agreed on their flags, the liveness watch, and every way
the job ends as one line (`run_job`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from examples.job_runtime import preemption, startup
from examples.job_runtime.errors import FlagError, ResumeError
from examples.job_runtime.processes import Processes, end_unexpected, exit_with


def run_job(job: str, flag_names, body: Callable[[Processes], object]) -> None:
    """Runs `body(processes)` as this process of the job the process flags describe, once every
    process agrees on the flags `flag_names` (and the process flags) and the liveness watch
    runs; then waits for every process to finish. `job`: the job's name, which starts every line
    it ends with (e.g. "train_moe: --mesh=ep=3 ...").

    SIGTERM (a scheduler's preemption) stops the job after its current step with a committed
    checkpoint: process 0 prints one line naming it and every process exits with status 143
    (`preemption.py`). An expected error (a bad flag, an output directory in use, an unusable
    --resume checkpoint, a non-finite loss, an I/O error) ends every process with one line
    naming it; any other as `processes.end_unexpected` says.
    """
    processes = Processes()
    try:
        pc = startup.config_from_flags()
        # First, in the main thread: SIGTERM is a stop request from here on.
        preemption.install(pc.stop_timeout_s, job)
        processes = startup.start(pc, job)
        preemption.reclaim()  # from jax.distributed's preemption notifier
        preemption.set_prefix(processes.error_prefix(job))
        names = [*flag_names, *startup.SHARED_FLAGS]
        # Before the watch: a flag error is then each process's own line, not a peer's verdict.
        processes.agree_on_flags(startup.command_line_values(names))
        processes.watch(job)
        body(processes)
        # Process 0 writes the outputs after the others' last step: they wait here (watched)
        # rather than in the runtime's shutdown barrier, whose timeout is short.
        processes.barrier("outputs written")
    except preemption.Stopped as stop:  # every process, after the same step's checkpoint
        processes.finish()
        if processes.is_main:
            print(f"{processes.error_prefix(job)}: {stop}", flush=True)
        sys.exit(preemption.STATUS)
    except (FlagError, ResumeError, FloatingPointError, OSError) as err:
        exit_with(processes, job, err)
    except BaseException as err:
        end_unexpected(processes, job, err)
    processes.finish()
