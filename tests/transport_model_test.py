"""The §2.1 model the GPU transport tests trust (tests/transport_helpers.py `Round.expected`),
held to the CPU kernels of the same steps (xla_ffi/cpu/kernels/exchange.h's pull transport:
PullRows, PullCombine, PullRowValues) on the same rounds, every output bit for bit; no GPU needed.
"""

from __future__ import annotations

import numpy as np
import pytest
from transport_helpers import EXCHANGE_ROUTINGS, Round, got_bits, stacked_inputs

from lab import native_module

native = native_module.testing_module()


def reference_rounds(rounds: list[Round], weighted: bool) -> list[dict]:
    """The rounds in order by the host kernels (`transport_reference`); each round's outputs."""
    stacked = stacked_inputs(rounds, weighted)
    out = native.transport_reference(rounds[0].dtype, rounds[0].C, **stacked)
    return [{key: value[n] for key, value in out.items()} for n in range(len(rounds))]


@pytest.mark.parametrize("routing", EXCHANGE_ROUTINGS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_numpy_model_matches_host_kernels(routing, dtype):
    """Two rounds, so a stale round would show."""
    rounds = [Round(routing, dtype, 7, R=4, seed=n) for n in range(2)]
    for weighted in (False, True):
        got = reference_rounds(rounds, weighted)
        for n, case in enumerate(rounds):
            for key, value in case.expected(weighted).items():
                np.testing.assert_array_equal(
                    *got_bits(got[n][key], value), err_msg=f"round {n} weighted={weighted}: {key}"
                )


def test_reference_hook_rejects_bad_shapes():
    case = Round("random", "float32", 4, R=2)
    args = stacked_inputs([case], weighted=False)
    with pytest.raises(ValueError, match=r"scale: expected shape \(1, 2,"):
        native.transport_reference("float32", case.C, **{**args, "scale": np.zeros((1, 2, 3))})
    bad = args["row_pos"].copy()
    bad[0, 0, 0, 0] = -1 if bad[0, 0, 0, 0] >= 0 else 0
    with pytest.raises(ValueError, match="dest and row_pos disagree on -1"):
        native.transport_reference("float32", case.C, **{**args, "row_pos": bad})
