"""The command-line job around `train` (train_moe.py's and cross_dc.py's): SIGTERM taken, the
processes started and agreed on their flags, the liveness watch, and every way the job ends as
one line (`run_job`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import train_processes
import train_startup
import train_stop
from train_checkpoint import ResumeError
from train_config import FlagError
from train_processes import Processes


def run_job(script: str, flag_names, body: Callable[[Processes], object]) -> None:
    """Runs `body(processes)` as this process of the job the process flags describe, once every
    process agrees on the flags `flag_names` (and the process flags) and the liveness watch
    runs; then waits for every process to finish.

    SIGTERM (a scheduler's preemption) stops the job after its current step with a committed
    checkpoint: process 0 prints one line naming it and every process exits with status 143
    (`train_stop.py`). An expected error (a bad flag, an output directory in use, an unusable
    --resume checkpoint, a non-finite loss, an I/O error) ends every process with one line
    naming it; any other as `train_processes.end_unexpected` says.
    """
    processes = Processes()
    try:
        pc = train_startup.config_from_flags()
        # First, in the main thread: SIGTERM is a stop request from here on.
        train_stop.install(pc.stop_timeout_s)
        train_stop.set_prefix(script)
        processes = train_startup.start(pc, script)
        train_stop.reclaim()  # from jax.distributed's preemption notifier
        train_stop.set_prefix(processes.error_prefix(script))
        names = [*flag_names, *train_startup.SHARED_FLAGS]
        # Before the watch: a flag error is then each process's own line, not a peer's verdict.
        processes.agree_on_flags(train_startup.command_line_values(names))
        processes.watch(script)
        body(processes)
        # Process 0 writes the outputs after the others' last step: they wait here (watched)
        # rather than in the runtime's shutdown barrier, whose timeout is short.
        processes.barrier("outputs written")
    except train_stop.Stopped as stop:  # every process, after the same step's checkpoint
        processes.finish()
        if processes.is_main:
            print(f"{processes.error_prefix(script)}: {stop}", flush=True)
        sys.exit(train_stop.STATUS)
    except (FlagError, ResumeError, FloatingPointError, OSError) as err:
        train_processes.exit_with(processes, script, err)
    except BaseException as err:
        train_processes.end_unexpected(processes, script, err)
    processes.finish()
