"""The main job, `python -m examples.train_moe`, interrupted or contended (one process; several:
tests/train_mp_faults_test.py):

* a scheduler's SIGTERM ends a run after its current step with a committed checkpoint, one line
  naming it and status 143, and `--resume` continues it bit for bit as if never stopped (before:
  SIGTERM's default action, nothing saved); the deadline (`--stop_timeout_s`) ends a run that
  cannot get there;
* a second run on a busy `--output_dir` is refused in one line naming the holder before anything
  is read or built (before: both trained and destroyed each other's checkpoints), a lock left by
  a dead run is taken over, and the lock is gone when a run ends;
* a checkpoint with files removed (the state's manifest or metadata, a process's data files) is
  refused in one line before orbax reads it (before: tracebacks of orbax's reader threads dying
  on a closed event loop came with the line, or the wrong line came).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
from mp_launch import worker_env
from train_harness import (
    ROOT,
    TINY,
    TRAIN_MOE,
    checkpoint,
    config,
    python_path_env,
    replace,
    train_moe,
)
from train_harness import train as _train

pytestmark = pytest.mark.usefixtures("no_backend_override")

STOP_STATUS = 128 + signal.SIGTERM
# TINY on the command line; the schedule ends at 1000 steps, whatever --steps says.
_NAMES = ("batch", "seq_len", "d_model", "d_ff", "layers", "heads", "mesh")
FLAGS = [f"--{k}={config.flag_values(TINY)[k]}" for k in _NAMES] + ["--schedule_steps=1000"]


def _start(out, *extra, log):
    return subprocess.Popen(
        [*TRAIN_MOE, *FLAGS, f"--output_dir={out}", *extra],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=worker_env(),
        text=True,
    )


def _wait_for(path, text, proc):
    """Until `text` is in the file at `path` (False when `proc` ended first)."""
    while True:
        with open(path) as f:
            if text in f.read():
                return True
        if proc.poll() is not None:
            return False
        time.sleep(0.1)


@pytest.fixture(scope="module")
def contended(tmp_path_factory):
    """A long run A (eval and a line every step); once it trains, a second run B on A's output
    directory; then SIGTERM to A."""
    out = tmp_path_factory.mktemp("contended")
    with open(out.parent / "a.log", "w") as log:
        a = _start(out, "--steps=1000", "--eval_every=1", log=log)
    try:
        assert _wait_for(out.parent / "a.log", "step     2:", a), (out.parent / "a.log").read_text()
        b = subprocess.run(
            [*TRAIN_MOE, *FLAGS, f"--output_dir={out}", "--steps=2"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env=worker_env(),
            timeout=300,
        )
        lock = json.loads((out / ".lock").read_text()) if (out / ".lock").exists() else None
        a_alive_after_b = a.poll() is None
        a.send_signal(signal.SIGTERM)
        a.wait(timeout=300)  # a hang guard, not a measurement
    finally:
        if a.poll() is None:
            a.kill()
            a.wait()
    return dict(
        out=out,
        a=a,
        a_log=(out.parent / "a.log").read_text(),
        b=b,
        lock=lock,
        a_alive_after_b=a_alive_after_b,
    )


def test_a_second_run_on_a_busy_output_dir_is_refused_in_one_line(contended):
    b, a = contended["b"], contended["a"]
    assert b.returncode == 1, b.stdout + b.stderr
    assert b.stdout == ""
    host = socket.gethostname()
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(contended["lock"]["started"]))
    assert b.stderr.strip().splitlines() == [
        f"train_moe: --output_dir={contended['out']} is in use by another run (train_moe, "
        f"pid {a.pid} on host {host}, started {started}): "
        "two runs would destroy each other's checkpoints; wait for it to end, stop it, or use "
        f"another --output_dir (its lock: {contended['out']}/.lock)"
    ], b.stderr
    assert contended["lock"]["pid"] == a.pid and contended["a_alive_after_b"]


def test_sigterm_commits_a_checkpoint_and_ends_in_one_line(contended):
    a, log, out = contended["a"], contended["a_log"], contended["out"]
    assert a.returncode == STOP_STATUS, log[-3000:]
    last = log.strip().splitlines()[-1]
    prefix = "train_moe: stopped by SIGTERM after step "
    assert last.startswith(prefix), log[-3000:]
    step = int(last[len(prefix) :].split()[0])
    assert last == (
        f"{prefix}{step} of 1000: checkpoint/{step}/ committed in {out}; --resume continues from it"
    )
    assert sorted(os.listdir(out / "checkpoint")) == [str(step)]
    assert not (out / ".lock").exists()
    metrics = json.loads((out / "metrics.json").read_text())
    assert [r["step"] for r in metrics["train"]] == list(range(step))


def test_resume_after_sigterm_continues_bit_for_bit(contended, tmp_path):
    out = contended["out"]
    step = len(json.loads((out / "metrics.json").read_text())["train"])
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(out, resumed_dir)
    steps = step + 2
    # As on the command line (which has no --eval_batches: its default).
    cfg = replace(
        TINY,
        steps=steps,
        schedule_steps=1000,
        eval_every=1,
        eval_batches=train_moe.TrainConfig().eval_batches,
    )
    resumed, text = _train(replace(cfg, resume=True, output_dir=str(resumed_dir)))
    assert f"resumed from step {step}" in text
    whole, _ = _train(replace(cfg, output_dir=str(tmp_path / "whole")))
    assert [r["step"] for r in resumed["train"]] == list(range(steps))
    for key in ("loss", "ce", "aux", "grad_norm", "dropped"):
        assert [r[key] for r in resumed["train"]] == [r[key] for r in whole["train"]], key
    assert resumed["eval"] == whole["eval"]


DEADLINE = """
import os, signal, time
from examples.job_runtime import preemption
preemption.install(1, "train_moe")
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(120)  # a job that cannot reach its next step
"""


def test_a_run_that_cannot_stop_in_time_ends_at_the_deadline():
    proc = subprocess.run(
        [sys.executable, "-c", DEADLINE],
        capture_output=True,
        text=True,
        timeout=100,
        env=python_path_env(),
    )
    assert proc.returncode == STOP_STATUS, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "train_moe: stopped by SIGTERM: no checkpoint committed within --stop_timeout_s=1 s; "
        "exiting (--resume continues from the last committed checkpoint)"
    ]


def _no_model(*args, **kwargs):
    raise AssertionError("a model was built although the output directory was in use")


def test_a_held_lock_is_refused_before_anything_is_read(tmp_path, monkeypatch):
    monkeypatch.setattr(train_moe, "MoETransformer", _no_model)
    out = tmp_path / "out"
    out.mkdir()
    holder = os.open(out / ".lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        owner = dict(pid=4242, host="elsewhere", job="train_moe", started=0)
        os.write(holder, json.dumps(owner).encode())
        cfg = replace(TINY, output_dir=str(out), resume=True)
        with pytest.raises(
            train_moe.FlagError,
            match=(
                f"^--output_dir={out} is in use by another run \\(train_moe, pid 4242 on host "
                "elsewhere, started .*\\): two runs would destroy each other's checkpoints"
            ),
        ):
            train_moe.train(cfg)
    finally:
        os.close(holder)
    assert os.listdir(out) == [".lock"]  # nothing read, nothing written


def test_the_lock_of_a_dead_run_is_taken_over_and_released(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid now names no process
    out = tmp_path / "out"
    out.mkdir()
    owner = dict(pid=dead.pid, host=socket.gethostname(), job="train_moe", started=0)
    (out / ".lock").write_text(json.dumps(owner))
    metrics, text = _train(replace(TINY, steps=1, output_dir=str(out)))
    assert (
        f"{out}: the run that held it before (train_moe, pid {dead.pid} on host "
        f"{socket.gethostname()}, started" in text
    )
    assert "is gone; its lock was taken over" in text
    assert not (out / ".lock").exists()
    assert metrics["train"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A finished tiny run's output directory (its checkpoint at step 3)."""
    cfg = replace(TINY, output_dir=str(tmp_path_factory.mktemp("saved")))
    _train(cfg)
    return cfg


REMOVED = {
    "manifest.ocdbt": ("state/manifest.ocdbt", "is corrupt: its state has no manifest.ocdbt"),
    "_METADATA": ("state/_METADATA", "is corrupt: its state has no _METADATA"),
    "a process's data": ("state/ocdbt.process_0/d", "is corrupt: its metadata cannot be read"),
}


@pytest.mark.parametrize("what", sorted(REMOVED))
def test_a_checkpoint_with_files_removed_is_refused_before_orbax_reads_it(
    saved, tmp_path, monkeypatch, what
):
    def no_orbax_read(*args, **kwargs):
        raise AssertionError("orbax read a checkpoint with files removed")

    out = tmp_path / "out"
    shutil.copytree(saved.output_dir, out)
    removed, message = REMOVED[what]
    target = out / "checkpoint" / "3" / removed
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    monkeypatch.setattr(checkpoint.ocp.CheckpointManager, "restore", no_orbax_read)
    monkeypatch.setattr(checkpoint.ocp.CheckpointManager, "item_metadata", no_orbax_read)
    ckpt = str(out / "checkpoint")
    with pytest.raises(train_moe.ResumeError) as err:
        checkpoint.read_saved(ckpt, checkpoint.latest(ckpt))
    assert f"the checkpoint {ckpt}/3 {message}" in str(err.value)
    assert "AssertionError" not in str(err.value)


def test_command_line_deleted_manifest_is_one_line(saved, tmp_path):
    """Before: the right line, with tracebacks of orbax's reader threads (5 of 6 runs)."""
    out = tmp_path / "out"
    shutil.copytree(saved.output_dir, out)
    (out / "checkpoint" / "3" / "state" / "manifest.ocdbt").unlink()
    proc = subprocess.run(
        [*TRAIN_MOE, *FLAGS, "--steps=5", "--resume", f"--output_dir={out}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=worker_env(),
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"train_moe: --resume: the checkpoint {out}/checkpoint/3 is corrupt: its state has no "
        "manifest.ocdbt (files were removed?); run without --resume to start afresh"
    ], proc.stderr
