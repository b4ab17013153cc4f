"""Checkpoints of examples/train_moe.py: committed atomically, read back with errors that say what
is wrong.

Layout: `<output_dir>/checkpoint/<step>/` is one orbax `CheckpointManager` step of two items,
`state` (params, rest and optimizer state) and `meta` (JSON: the flags of the run that wrote it).
Orbax writes a step into a temporary directory beside it and renames that into place only once
every file is written, so a crash mid-save leaves no partial `<step>/`; the other steps are
deleted only after the new one is committed. A crash at any point therefore leaves the previous
checkpoint restorable (tests/train_moe_test.py kills a run at the commit to check it).

`restore` reads the newest step and raises `ResumeError` naming the directory and the problem:
missing, empty or incomplete, unreadable, or written by a run whose model differs (the flags that
differ are named) — never an orbax traceback.
"""

from __future__ import annotations

import os
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp

ITEMS = ("state", "meta")


class ResumeError(ValueError):
    """--resume cannot continue from the checkpoint directory; the message names it and why."""


def _manager(ckpt_dir: str, create: bool) -> ocp.CheckpointManager:
    # Saving is synchronous (the run ends right after), and retention is ours: old steps go only
    # once the new one is committed.
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None, create=create, enable_async_checkpointing=False
    )
    handlers = dict(state=ocp.StandardCheckpointHandler(), meta=ocp.JsonCheckpointHandler())
    return ocp.CheckpointManager(ckpt_dir, item_handlers=handlers, options=options)


def save(ckpt_dir: str, step: int, state, meta: dict) -> None:
    """Commits `state` (a pytree of arrays) and `meta` (JSON-able) as step `step` of `ckpt_dir`,
    then deletes every other entry of `ckpt_dir` (older steps, leftovers of crashed saves)."""
    os.makedirs(ckpt_dir, exist_ok=True)
    stale = os.path.join(ckpt_dir, str(step))
    if os.path.isdir(stale):
        # The same step, written by an earlier run that this (not resumed) one replaces: moved
        # aside, not deleted, until the new step is committed.
        if os.path.isdir(f"{stale}.replaced"):
            shutil.rmtree(f"{stale}.replaced")  # an older copy, left by a crashed save
        os.replace(stale, f"{stale}.replaced")
    with _manager(ckpt_dir, create=True) as mgr:
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        mgr.save(step, args=args, force=True)
        mgr.wait_until_finished()
    for name in os.listdir(ckpt_dir):
        if name != str(step):
            path = os.path.join(ckpt_dir, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


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


def restore(ckpt_dir: str, step: int, target, meta: dict, model_flags) -> object:
    """The state of step `step` (from `latest`) restored onto `target`'s shapes, dtypes and
    shardings; ResumeError when it cannot be read or does not fit.

    `meta` is this run's (as `save` gets it); `model_flags` are its keys that fix the state's
    shapes, named when the checkpoint's shapes differ from `target`'s.
    """
    step_dir = os.path.join(ckpt_dir, str(step))
    fix = _fix(_steps(ckpt_dir))
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    with _manager(ckpt_dir, create=False) as mgr:
        try:
            saved_meta = mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
            saved_meta = saved_meta["meta"]
            saved_shapes = mgr.item_metadata(step)["state"]
        except Exception as err:  # orbax raises many types for unreadable files
            raise ResumeError(
                f"--resume: the checkpoint {step_dir} is corrupt: its metadata cannot be read"
                f"{_kind(err)}{fix}"
            ) from err
        mismatch = _shape_mismatch(saved_shapes, abstract)
        if mismatch:
            changed = [
                f"--{k}={saved_meta.get(k)} (this run: {meta[k]})"
                for k in model_flags
                if isinstance(saved_meta, dict) and saved_meta.get(k) != meta[k]
            ]
            why = f"; it was written with {', '.join(changed)}" if changed else ""
            raise ResumeError(
                f"--resume: the checkpoint {step_dir} does not fit this run's model: {mismatch}"
                f"{why}. Resume with the flags it was written with, or run without --resume"
            )
        try:
            restored = mgr.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
            )
            state = jax.block_until_ready(restored["state"])
        except Exception as err:
            raise ResumeError(
                f"--resume: the checkpoint {step_dir} is corrupt: its arrays cannot be read"
                f"{_kind(err)}{fix}"
            ) from err
    return state


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
