"""Byte-level language-modelling data from text every Python install ships: its stdlib source.

The corpus is the standard library's own top-level `*.py` files (the directory of `os.__file__`),
read in sorted name order and concatenated, so a run needs no download and is reproducible for a
given Python version. Tokens are raw bytes (vocabulary 256). The last `eval_fraction` of the
concatenation is held out for evaluation. Training batches are random windows drawn from a
generator seeded by (seed, step), so a resumed run sees exactly the batches the first run would
have seen next.
"""

from __future__ import annotations

import dataclasses
import glob
import os

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

    def train_batch(self, seed: int, step: int, batch: int, seq_len: int):
        """Random windows for one step: (inputs, targets), each [batch, seq_len] int32.

        Depends only on (seed, step), so resuming reproduces the original sequence of batches.
        """
        rng = np.random.default_rng([seed, step])
        starts = rng.integers(0, len(self.train) - seq_len - 1, size=batch)
        return _windows(self.train, starts, seq_len)

    def eval_batches(self, num_batches: int, batch: int, seq_len: int):
        """Fixed, evenly spaced windows over the held-out text: a list of (inputs, targets)."""
        count = num_batches * batch
        last = len(self.eval) - seq_len - 1
        if last < count:
            raise ValueError(
                f"eval text has {len(self.eval)} bytes, too few for {count} windows of {seq_len}"
            )
        starts = np.linspace(0, last, count).astype(np.int64).reshape(num_batches, batch)
        return [_windows(self.eval, s, seq_len) for s in starts]


def _windows(data: np.ndarray, starts: np.ndarray, seq_len: int):
    index = starts[:, None] + np.arange(seq_len + 1)[None, :]
    window = data[index].astype(np.int32)
    return window[:, :-1], window[:, 1:]
