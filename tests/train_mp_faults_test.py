"""The main job (`python -m examples.train_moe`) as several processes when start-up or the job
goes wrong:

* start-up ends in one line naming the coordinator's address, before the runtime starts or before
  its own timeout aborts the process natively: process 0 whose port another program holds (a
  plain listener, or another job's coordinator, which is left alone; before, the two
  coordinators shared the port and the first one aborted), a process that finds no coordinator,
  a job whose processes do not all come;
* SIGTERM to one process of a job (a scheduler's preemption) stops every process after the same
  step with one committed checkpoint, process 0 naming it in one line, status 143 everywhere
  (before: jax.distributed's preemption notifier caught SIGTERM and the job trained on); the
  output directory's lock, taken by process 0, refuses another run meanwhile;
* the watch of the coordinator names a lost coordinator the moment its connection breaks.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time

import pytest
from mp_launch import free_port, worker_env
from train_harness import ROOT, TRAIN_MOE

from examples.job_runtime.processes import Processes

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

STOP_STATUS = 128 + signal.SIGTERM
FLAGS = [
    "--batch=8",
    "--seq_len=32",
    "--d_model=32",
    "--d_ff=32",
    "--layers=1",
    "--heads=2",
    "--mesh=node=2,local=4",
    "--heartbeat_timeout_s=10",
]


def _process(port, index, out, *extra, count=2, **popen):
    cmd = [
        *TRAIN_MOE,
        *FLAGS,
        f"--output_dir={out}",
        "--steps=3",
        f"--coordinator_address=127.0.0.1:{port}",
        f"--num_processes={count}",
        f"--process_id={index}",
        *extra,
    ]
    return subprocess.Popen(cmd, cwd=ROOT, env=worker_env(), text=True, **popen)


def _one_line_exit(proc) -> str:
    stdout, stderr = proc.communicate(timeout=300)  # a hang guard, not a measurement
    assert proc.returncode == 1, stderr[-3000:]
    assert stdout == ""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def test_a_coordinator_port_held_by_a_listener_is_refused_in_one_line(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = _process(
            port, 0, tmp_path, "--init_timeout_s=30", stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        line = _one_line_exit(proc)
    assert line == (
        f"train_moe: --coordinator_address=127.0.0.1:{port}: port {port} is already in use on "
        "this host (another job's coordinator?); start the job on a free port"
    )


def test_another_jobs_coordinator_port_is_refused_and_that_job_left_alone(tmp_path):
    port = free_port()
    first = _process(
        port,
        0,
        tmp_path / "first",
        "--init_timeout_s=120",
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while True:  # until its coordinator listens
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert first.poll() is None and time.monotonic() < deadline
                time.sleep(0.2)
        second = _process(
            port,
            0,
            tmp_path / "second",
            "--init_timeout_s=120",
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert "port" in _one_line_exit(second)
        # The first job still assembles: its process 1 joins it and it trains to the end.
        other = _process(
            port,
            1,
            tmp_path / "first",
            "--init_timeout_s=120",
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        _, err1 = other.communicate(timeout=300)
        assert other.returncode == 0, err1[-3000:]
        first.wait(timeout=300)
        assert first.returncode == 0, first.stderr.read()[-3000:]
    finally:
        for p in (first,):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_a_process_that_finds_no_coordinator_ends_in_one_line(tmp_path):
    port = free_port()  # nothing listens there
    proc = _process(
        port, 1, tmp_path, "--init_timeout_s=3", stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    line = _one_line_exit(proc)
    assert line.startswith(
        f"train_moe: cannot join the job at 127.0.0.1:{port} as process 1: no coordinator "
        "answered there within 3 s ("
    ), line


def test_a_job_whose_processes_do_not_all_come_ends_in_one_line(tmp_path):
    port = free_port()
    proc = _process(
        port, 0, tmp_path, "--init_timeout_s=4", stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    line = _one_line_exit(proc)
    assert line == (
        f"train_moe (process 0 of 2): cannot join the job at 127.0.0.1:{port} as process 0: "
        "its 2 processes did not all come within 4 s (is every process started, with the same "
        "--coordinator_address and --num_processes?)"
    )


def _read(path) -> str:
    with open(path) as f:
        return f.read()


@pytest.fixture(scope="module")
def preempted(tmp_path_factory):
    """A 2-process job; once it trains, another run on its output directory; then SIGTERM to
    process 1 alone."""
    out = tmp_path_factory.mktemp("preempted")
    port = free_port()
    logs = [out.parent / f"p{i}.log" for i in range(2)]
    procs = []
    for i, log in enumerate(logs):
        with open(log, "w") as f:
            procs.append(
                _process(
                    port,
                    i,
                    out,
                    "--steps=1000",
                    "--eval_every=1",
                    "--schedule_steps=1000",
                    stdout=f,
                    stderr=subprocess.STDOUT,
                )
            )
    try:
        while "step     2:" not in _read(logs[0]):
            assert all(p.poll() is None for p in procs), _read(logs[0]) + _read(logs[1])
            time.sleep(0.1)
        other = subprocess.run(
            [
                *TRAIN_MOE,
                *FLAGS[:-2],
                "--mesh=ep=8",
                f"--output_dir={out}",
                "--steps=2",
            ],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=worker_env(),
            timeout=300,
        )
        procs[1].send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(timeout=300)  # hang guards, not measurements
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return dict(out=out, procs=procs, logs=[_read(log) for log in logs], other=other)


def test_sigterm_to_one_process_stops_the_job_after_one_step_with_a_checkpoint(preempted):
    out, procs, logs = preempted["out"], preempted["procs"], preempted["logs"]
    assert [p.returncode for p in procs] == [STOP_STATUS, STOP_STATUS], logs[0][-2000:] + logs[1]
    last = logs[0].strip().splitlines()[-1]
    prefix = "train_moe (process 0 of 2): stopped by SIGTERM after step "
    assert last.startswith(prefix), logs[0][-3000:]
    step = int(last[len(prefix) :].split()[0])
    assert last.endswith(f"checkpoint/{step}/ committed in {out}; --resume continues from it")
    assert logs[1] == ""  # process 1 prints nothing
    assert sorted(os.listdir(out / "checkpoint")) == [str(step)]
    with open(out / "metrics.json") as f:
        assert [r["step"] for r in json.load(f)["train"]] == list(range(step))
    assert not (out / ".lock").exists()


def test_the_jobs_output_dir_lock_refuses_another_run(preempted):
    other, procs = preempted["other"], preempted["procs"]
    assert other.returncode == 1, other.stderr[-3000:]
    lines = other.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"train_moe: --output_dir={preempted['out']} is in use by another run (train_moe, "
        f"pid {procs[0].pid} on host {socket.gethostname()}"
    ), other.stderr


class _Client:
    """A runtime client whose waits on a key end as given (an exception, or a value)."""

    def __init__(self, outcomes):
        self.outcomes, self.calls = list(outcomes), 0

    def blocking_key_value_get(self, key, timeout_ms):
        self.calls += 1
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


def test_the_coordinators_watch_names_a_lost_coordinator_at_once():
    lines = []

    class Watched(Processes):
        def die(self, line, dead=None):
            lines.append(line)
            self._stop.set()

    timeout = Exception("DEADLINE_EXCEEDED: Deadline Exceeded")
    lost = Exception("UNAVAILABLE: Stream removed (Socket closed)")
    processes = Watched(1, 2, _Client([timeout, lost]))
    processes._watch_coordinator("train_moe (process 1 of 2)")
    assert lines == [
        "train_moe (process 1 of 2): lost the coordinator (process 0): Exception: UNAVAILABLE: "
        "Stream removed (Socket closed); stopping this process too. --resume continues from the "
        "last committed checkpoint"
    ]
    assert processes._client.calls == 2  # a wait that timed out is waited again
    finished = Watched(1, 2, _Client([lost]))
    finished._stop.set()  # this process finished: its client's shutdown ends the wait quietly
    finished._watch_coordinator("train_moe (process 1 of 2)")
    released = Watched(1, 2, _Client(["1"]))  # `finish` set the key it waits on
    released._watch_coordinator("train_moe (process 1 of 2)")
    assert len(lines) == 1
