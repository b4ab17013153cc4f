"""Byte-level language-modelling data from text every Python install ships: its stdlib source.

The corpus is the standard library's own top-level `*.py` files (the directory of `os.__file__`),
read in sorted name order and concatenated, so a run needs no download and is reproducible for a
given Python version. Tokens are raw bytes (vocabulary 256). The last `eval_fraction` of the
concatenation is held out for evaluation. Training batches are random windows drawn from a
generator seeded by (seed, step), so a resumed run sees exactly the batches the first run would
have seen next.

`ShardFeeder` builds each global batch from this process's rows only: with several processes
(`job_runtime/processes.py`) every process draws the same window starts (a few integers), reads the
windows of the rows its own devices hold, and assembles the global array from them
(`jax.make_array_from_callback`); the global batch is the one a single process would build.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import os

import jax
import numpy as np

VOCAB_SIZE = 256


def stdlib_corpus() -> bytes:
    """The concatenated bytes of the stdlib's top-level *.py files, in sorted name order."""
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
    if not files:
        raise FileNotFoundError(f"no *.py files next to {os.__file__}; cannot build the corpus")
    chunks = []
    for path in files:
        with open(path, "rb") as f:
            chunks.append(f.read())
    return b"\n".join(chunks)


@dataclasses.dataclass(frozen=True)
class ByteData:
    """Train and eval byte streams (uint8 numpy arrays).

    Attributes:
      train: [N_train] uint8, the first (1 - eval_fraction) of the corpus.
      eval: [N_eval] uint8, the rest (held out).
    """

    train: np.ndarray
    eval: np.ndarray

    @classmethod
    def load(cls, eval_fraction: float = 0.05) -> ByteData:
        data = np.frombuffer(stdlib_corpus(), np.uint8)
        split = int(len(data) * (1.0 - eval_fraction))
        return cls(train=data[:split], eval=data[split:])

    def digest(self) -> str:
        """A short digest of both streams (processes compare theirs)."""
        h = hashlib.sha256(self.train.tobytes())
        h.update(self.eval.tobytes())
        return h.hexdigest()[:16]

    def train_batch(self, seed: int, step: int, batch: int, seq_len: int, rows=None):
        """Random windows for one step: (inputs, targets), each [batch, seq_len] int32, or
        [len(rows), seq_len] with `rows` (indices into the batch): only those rows are read.

        Depends only on (seed, step), so resuming reproduces the original sequence of batches.
        """
        rng = np.random.default_rng([seed, step])
        starts = rng.integers(0, len(self.train) - seq_len - 1, size=batch)
        return _windows(self.train, starts if rows is None else starts[rows], seq_len)

    def eval_batches(self, num_batches: int, batch: int, seq_len: int, rows=None):
        """Fixed, evenly spaced windows over the held-out text: a list of (inputs, targets),
        each [batch, seq_len] int32 (or only `rows` of each batch, as `train_batch`)."""
        count = num_batches * batch
        last = len(self.eval) - seq_len - 1
        if last < count:
            raise ValueError(
                f"eval text has {len(self.eval)} bytes, too few for {count} windows of {seq_len}"
            )
        starts = np.linspace(0, last, count).astype(np.int64).reshape(num_batches, batch)
        return [_windows(self.eval, s if rows is None else s[rows], seq_len) for s in starts]


class ShardFeeder:
    """Global [batch, seq_len] batches on `sharding`, this process reading only its own rows.

    Attributes:
      rows: the batch rows this process's devices hold (sorted; all of them when the batch is
        replicated, or with one process).
      windows_read: windows this process has read so far (train and eval).
    """

    def __init__(self, data: ByteData, sharding, batch: int, seq_len: int):
        self.data, self.sharding, self.shape = data, sharding, (batch, seq_len)
        index = sharding.addressable_devices_indices_map(self.shape)
        rows = set()
        for where in index.values():
            rows.update(range(*where[0].indices(batch)))
        self.rows = np.asarray(sorted(rows), np.int64)
        self._position = np.full(batch, -1, np.int64)
        self._position[self.rows] = np.arange(len(self.rows))
        self.windows_read = 0

    def train_batch(self, seed: int, step: int):
        """(inputs, targets) of step `step`, global arrays."""
        local = self.data.train_batch(seed, step, *self.shape, rows=self.rows)
        self.windows_read += len(self.rows)
        return tuple(self._global(a) for a in local)

    def eval_batches(self, num_batches: int):
        """The held-out batches as global (inputs, targets) pairs."""
        local = self.data.eval_batches(num_batches, *self.shape, rows=self.rows)
        self.windows_read += num_batches * len(self.rows)
        return [tuple(self._global(a) for a in pair) for pair in local]

    def _global(self, local: np.ndarray):
        """[len(rows), seq_len] of this process -> the global [batch, seq_len] array."""

        def shard(index):
            rows = self._position[np.arange(self.shape[0])[index[0]]]
            return local[rows][:, index[1]]

        return jax.make_array_from_callback(self.shape, self.sharding, shard)


def _windows(data: np.ndarray, starts: np.ndarray, seq_len: int):
    index = starts[:, None] + np.arange(seq_len + 1)[None, :]
    window = data[index].astype(np.int32)
    return window[:, :-1], window[:, 1:]
