"""The send kernel's staging plan (xla_ffi/cuda/kernels/send_plan.h), which the GPU launch uses
and Python asks the production module for (`send_plan`): plain host arithmetic, in every build, so
it is checked on any machine (docs/gpu.md)."""

from __future__ import annotations

import numpy as np

from jax_hybridep import _native
from jax_hybridep.exchange import cuda

send_plan = _native.module().send_plan
KIB = 1024


def test_send_plan_stages_whole_rows_in_opted_in_shared_memory():
    """H = 7168 bf16 rows over 8 GPUs: 10-12 whole-row stages, > 140 KiB of dynamic shared
    memory (more than the 48 KiB a block gets without opting in), under the 227 KiB limit."""
    for fp8_hidden in (0, 7168):
        plan = send_plan(7168 * 2, 8, fp8_hidden=fp8_hidden)
        assert plan["pieces"] == 1 and plan["stage_bytes"] == 7168 * 2
        assert 10 <= plan["stages"] <= 12, plan
        assert 140 * KIB <= plan["smem_bytes"] <= 227 * KIB - 2 * KIB, plan
        assert plan["threads"] == 128 and plan["s2g_warps"] == 3
    # Rows too wide for 4 whole stages go in pieces; FP8 needs whole tokens.
    wide = send_plan(96 * KIB, 8)
    assert wide["pieces"] >= 2 and wide["stages"] >= 4 and wide["smem_bytes"] <= 227 * KIB
    assert send_plan(150 * KIB, 8, fp8_hidden=75 * KIB)["stages"] == 0


def test_every_send_plan_has_the_stages_its_warps_need():
    """Fewer than 4 stages would deadlock the loader warp against the 3 store warps (the waits
    on shared-memory barriers have no timeout): every plan has >= 4 or none, its pieces cover
    the row and it fits the budget (e.g. budget 106144 with 100000-byte rows once gave 3)."""
    rng = np.random.default_rng(0)
    cases = [(100000, 106144)] + [
        (int(rng.integers(16, 200 * KIB)), int(rng.integers(8 * KIB, 227 * KIB)))
        for _ in range(2000)
    ]
    for row, budget in cases:
        plan = send_plan(row, 8, budget=budget)
        if plan["stages"] == 0:
            continue
        assert plan["stages"] >= 4, (row, budget, plan)
        assert plan["pieces"] * plan["stage_bytes"] >= row and plan["stage_bytes"] % 16 == 0
        assert plan["smem_bytes"] <= budget, (row, budget, plan)


def test_fp8_dispatch_too_wide_for_the_send_is_refused_at_trace_time():
    """The trace-time check of FP8 on the GPU route (cuda.fp8_token_fits) is the send kernel's
    own plan: a 48 KiB token fits the maps of 61 GPUs, not 62."""
    assert cuda.fp8_token_fits(48 * KIB, 61, 24576)
    assert not cuda.fp8_token_fits(48 * KIB, 62, 24576)
