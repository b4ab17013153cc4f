"""Checkpoints of the main job: committed atomically, read back with errors that say what is
wrong.

Layout: `<output_dir>/checkpoint/<step>/` is one orbax `CheckpointManager` step of two items,
`state` (params, rest and optimizer state) and `meta` (JSON: the flags of the run that wrote it).
Orbax writes a step into a temporary directory beside it and renames that into place only once
every file is written, so a crash mid-save leaves no partial `<step>/`; the other steps are
deleted only after the new one is committed. A crash at any point therefore leaves the previous
checkpoint restorable (tests/train_moe_test.py kills a run at the commit to check it).

With several processes (`job_runtime/processes.py`) every process writes the shards of the arrays
its devices hold and process 0 commits the step once all are written (orbax's multi-process save;
`--output_dir` must then be a filesystem every process sees); process 0 alone prepares and cleans up
the directory, between barriers.

`--resume` reads the newest step's meta before any model is built (`read_saved`) and refuses,
in one line naming the flag and both values, a checkpoint written with another value of a flag
that shapes the model, its routing, its data or its optimizer (every flag but
`config.RESUMABLE_FIELDS`), by another number of processes or on another mesh
(`check_resume_flags`); `restore` then reads the state. Each raises `ResumeError` naming the
directory and the problem: missing, empty or incomplete, unreadable, written by another run —
never an orbax traceback.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

from examples.job_runtime.errors import ResumeError
from examples.job_runtime.processes import Processes
from examples.train_moe.config import RESUMABLE_FIELDS, RESUMABLE_FLAGS

ITEMS = ("state", "meta")


def _manager(ckpt_dir: str, create: bool) -> ocp.CheckpointManager:
    # Saving is synchronous (the run ends right after), and retention is ours: old steps go only
    # once the new one is committed.
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None, create=create, enable_async_checkpointing=False
    )
    handlers = dict(state=ocp.StandardCheckpointHandler(), meta=ocp.JsonCheckpointHandler())
    return ocp.CheckpointManager(ckpt_dir, item_handlers=handlers, options=options)


def save(ckpt_dir: str, step: int, state, meta: dict, processes: Processes | None = None) -> None:
    """Commits `state` (a pytree of arrays) and `meta` (JSON-able) as step `step` of `ckpt_dir`,
    then deletes every other entry of `ckpt_dir` (older steps, leftovers of crashed saves).
    With several `processes`, called by every process (each writes its shards)."""
    processes = processes or Processes()
    if processes.is_main:
        os.makedirs(ckpt_dir, exist_ok=True)
        stale = os.path.join(ckpt_dir, str(step))
        if os.path.isdir(stale):
            # The same step, written by an earlier run that this (not resumed) one replaces:
            # moved aside, not deleted, until the new step is committed.
            if os.path.isdir(f"{stale}.replaced"):
                shutil.rmtree(f"{stale}.replaced")  # an older copy, left by a crashed save
            os.replace(stale, f"{stale}.replaced")
    processes.barrier(f"save {step}: directory ready")
    with _manager(ckpt_dir, create=True) as mgr:
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        mgr.save(step, args=args, force=True)
        mgr.wait_until_finished()
    processes.barrier(f"save {step}: committed")
    if processes.is_main:
        for name in os.listdir(ckpt_dir):
            if name != str(step):
                path = os.path.join(ckpt_dir, name)
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    processes.barrier(f"save {step}: cleaned up")


def _steps(ckpt_dir: str) -> list[int]:
    names = os.listdir(ckpt_dir)
    return sorted(int(n) for n in names if n.isdigit() and os.path.isdir(os.path.join(ckpt_dir, n)))


def latest(ckpt_dir: str) -> int:
    """The newest step of `ckpt_dir`, checked to be a whole checkpoint on disk; ResumeError when
    there is none or it is empty or incomplete. Cheap: run it before building a model."""
    if not os.path.isdir(ckpt_dir):
        raise ResumeError(
            f"--resume: there is no checkpoint directory {ckpt_dir} (no run saved into this "
            "--output_dir yet); run without --resume first"
        )
    steps = _steps(ckpt_dir)
    if not steps:
        leftovers = sorted(os.listdir(ckpt_dir))
        detail = f" (only unfinished saves: {', '.join(leftovers)})" if leftovers else ""
        raise ResumeError(f"--resume: no checkpoint in {ckpt_dir}{detail}")
    step = steps[-1]
    step_dir = os.path.join(ckpt_dir, str(step))
    if not os.listdir(step_dir):
        raise ResumeError(
            f"--resume: the checkpoint {step_dir} is empty (its files are gone){_fix(steps)}"
        )
    missing = [i for i in ITEMS if not os.path.isdir(os.path.join(step_dir, i))]
    if missing:
        raise ResumeError(
            f"--resume: the checkpoint {step_dir} is incomplete: it has no {' or '.join(missing)}/ "
            f"(it was not written by this script, or files were removed){_fix(steps)}"
        )
    return step


def _fix(steps: list[int]) -> str:
    older = f", or delete it to resume from step {steps[-2]}" if len(steps) > 1 else ""
    return f"; run without --resume to start afresh{older}"


@dataclasses.dataclass(frozen=True)
class Saved:
    """What `read_saved` found in a checkpoint step: its meta (the flags of the run that wrote
    it, JSON) and its state's metadata (shapes and dtypes by path, no arrays)."""

    meta: dict
    shapes: object


def read_saved(ckpt_dir: str, step: int) -> Saved:
    """The meta and state metadata of step `step` (from `latest`): cheap, before a model is
    built; ResumeError when either cannot be read."""
    step_dir = os.path.join(ckpt_dir, str(step))
    with _manager(ckpt_dir, create=False) as mgr:
        try:
            _check_state(os.path.join(step_dir, "state"))
            meta = mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
            meta = meta["meta"]
            shapes = mgr.item_metadata(step)["state"]
        except _Missing as err:
            raise ResumeError(
                f"--resume: the checkpoint {step_dir} is corrupt: {err} (files were removed?)"
                f"{_fix(_steps(ckpt_dir))}"
            ) from None
        except Exception as err:  # orbax raises many types for unreadable files
            raise ResumeError(
                f"--resume: the checkpoint {step_dir} is corrupt: its metadata cannot be read"
                f"{_kind(err)}{_fix(_steps(ckpt_dir))}"
            ) from err
    if not isinstance(meta, dict):
        raise ResumeError(
            f"--resume: the checkpoint {step_dir} is corrupt: its meta is not a JSON object"
            f"{_fix(_steps(ckpt_dir))}"
        )
    return Saved(meta, shapes)


# Files of the state item without which orbax's concurrent readers fail on a closed event loop,
# each printing a traceback from its thread (or the item reads as another model's).
STATE_FILES = ("_METADATA", "manifest.ocdbt")


class _Missing(ValueError):
    """A file of the checkpoint is gone."""


def _check_state(state_dir: str) -> None:
    """Checks, in blocking calls that print nothing, what orbax would otherwise find broken in
    concurrent reads (whose failures leave its other reads to fail later on a closed event loop,
    each printing a traceback from its thread, after the run's own last line): the state's
    metadata and manifest exist, and every OCDBT database of it (the job's and each process's)
    lists its keys and reads the first byte of each value (so a removed data file is found
    without reading the arrays)."""
    for name in STATE_FILES:
        if not os.path.isfile(os.path.join(state_dir, name)):
            raise _Missing(f"its state has no {name}")
    bases = [state_dir] + sorted(
        os.path.join(state_dir, n) for n in os.listdir(state_dir) if n.startswith("ocdbt.process_")
    )
    for base in bases:
        spec = {"driver": "ocdbt", "base": f"file://{os.path.abspath(base)}"}
        store = ts.KvStore.open(spec).result()
        reads = [store.read(key, byte_range=slice(0, 1)) for key in store.list().result()]
        for read in reads:
            read.result()


def _spell(value) -> str:
    """A flag's value as the command line spells it."""
    if value is None:
        return "(unset)"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _count(processes: int) -> str:
    return f"{processes} process{'es' if processes != 1 else ''}"


def check_resume_flags(ckpt_dir: str, step: int, saved: dict, meta: dict, defaults: dict) -> None:
    """ResumeError, in one line naming the flag and both values, when this run (`meta`, as
    `save` gets it) differs from the checkpoint's `saved` meta in a flag outside
    `RESUMABLE_FIELDS`, in its number of processes or in its mesh. `defaults`: the value of a
    flag that a checkpoint written before the flag existed ran with."""
    step_dir = os.path.join(ckpt_dir, str(step))
    fix = "or run without --resume to start afresh"
    was = (saved.get("processes", 1), saved.get("mesh_shape"))
    now = (meta["processes"], meta["mesh_shape"])
    if was[0] != now[0] or (was[1] is not None and was[1] != now[1]):
        raise ResumeError(
            f"--resume: the checkpoint {step_dir} was written by {_count(was[0])} on "
            f"--mesh={was[1]}; this run has {_count(now[0])} on --mesh={now[1]}: resume with "
            f"{_count(was[0])} and --mesh={was[1]}, {fix}"
        )
    for name, default in defaults.items():
        if name in RESUMABLE_FIELDS or (name == "mesh" and was[1] is not None):
            continue  # the mesh is compared as resolved above ("node=2,local=4" for none given)
        theirs, ours = saved.get(name, default), meta[name]
        if json.loads(json.dumps(ours)) != theirs:
            free = ", ".join(f"--{n}" for n in RESUMABLE_FLAGS)
            raise ResumeError(
                f"--resume: the checkpoint {step_dir} was written with --{name}={_spell(theirs)}, "
                f"this run has --{name}={_spell(ours)}: resume with --{name}={_spell(theirs)} "
                f"(only {free} may change), {fix}"
            )


def restore(ckpt_dir: str, step: int, target, saved: Saved, meta: dict, model_flags) -> object:
    """The state of step `step` (from `latest`), restored onto `target`'s shapes, dtypes and
    shardings (each process reads the shards its devices hold); ResumeError when it cannot be
    read or does not fit.

    `saved` is the checkpoint's (`read_saved`), `meta` this run's (as `save` gets it);
    `model_flags` are its keys that fix the state's shapes, named when the checkpoint's shapes
    differ from `target`'s.
    """
    step_dir = os.path.join(ckpt_dir, str(step))
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    mismatch = _shape_mismatch(saved.shapes, abstract)
    if mismatch:
        changed = [
            f"--{k}={saved.meta.get(k)} (this run: {meta[k]})"
            for k in model_flags
            if saved.meta.get(k) != meta[k]
        ]
        why = f"; it was written with {', '.join(changed)}" if changed else ""
        raise ResumeError(
            f"--resume: the checkpoint {step_dir} does not fit this run's model: {mismatch}"
            f"{why}. Resume with the flags it was written with, or run without --resume"
        )
    with _manager(ckpt_dir, create=False) as mgr:
        try:
            restored = mgr.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
            )
            return jax.block_until_ready(restored["state"])
        except Exception as err:
            raise ResumeError(
                f"--resume: the checkpoint {step_dir} is corrupt: its arrays cannot be read"
                f"{_kind(err)}{_fix(_steps(ckpt_dir))}"
            ) from err


def _kind(err: Exception) -> str:
    """The failure's kind for a message, e.g. " (JSONDecodeError)"; none for a bare Exception
    (the array reader's), whose text is the reader's internals."""
    return "" if type(err) is Exception else f" ({type(err).__name__})"


def _leaves(tree) -> dict[str, object]:
    """Leaves by path, spelled alike for a live tree and orbax's metadata of it
    ("opt_state/1/0/count"): orbax stores attributes and ints as dict keys."""

    def part(key):
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                return str(getattr(key, attr))
        return str(key)

    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(part(k) for k in path): leaf for path, leaf in flat}


def _shape_mismatch(saved, abstract) -> str | None:
    """The first difference in structure, shape or dtype between the saved tree's metadata and
    the abstract target, in words, or None."""
    saved, want = _leaves(saved), _leaves(abstract)
    for path, leaf in want.items():
        got = saved.get(path)
        if got is None:
            return f"it has no {path}"
        shape = tuple(getattr(got, "shape", None) or ())
        if shape != tuple(leaf.shape):
            return f"{path} has shape {shape} there, {tuple(leaf.shape)} here"
        dtype = getattr(got, "dtype", None)
        if dtype is not None and np.dtype(dtype) != np.dtype(leaf.dtype):
            return f"{path} is {np.dtype(dtype)} there, {np.dtype(leaf.dtype)} here"
    extra = sorted(set(saved) - set(want))
    if extra:
        return f"it has {extra[0]}, which this model has not"
    return None


def read_metrics(path: str) -> dict | None:
    """The metrics.json a resumed run extends (None when there is none); ResumeError when it
    cannot be read."""
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            old = json.load(f)
        for key in ("train", "eval"):
            if not all(isinstance(r, dict) and isinstance(r.get("step"), int) for r in old[key]):
                raise ValueError(f"{key} entries without a step")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ResumeError(
            f"--resume: {path} cannot be read ({type(err).__name__}: {err}); delete it to resume "
            "without the earlier run's history"
        ) from None
    return old
