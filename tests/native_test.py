"""The native module: registration and the float conversions the host kernels rely on."""

import ml_dtypes
import numpy as np
import pytest

from jax_hybridep import _native, config
from jax_hybridep.exchange import cuda_bottom


def test_handlers_registered():
    targets = set(_native.module().cpu_registrations())
    one_level = {"layout", "layout_gathered", "dispatch", "combine_vjp", "combine",
                 "return_row_values", "fp8_quantize"}  # fmt: skip
    per_level = {"level_send", "level_pack", "expand_items", "expand_items_vjp",
                 "item_partials", "blocks_all_to_all", "level_reduce", "level_reduce_pull",
                 "level_pick"}  # fmt: skip
    assert targets == {f"jax_hybridep_{name}" for name in one_level | per_level}


def test_python_mirrors_the_native_limits():
    """Constants checked on the Python side equal the kernels' own (xla_ffi/limits.h)."""
    limits = _native.module().limits()
    assert config.MAX_SMS == limits["max_send_blocks"]
    assert cuda_bottom.MAX_TOP_K == limits["max_top_k"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_round_to_nearest_even_like_numpy(dtype):
    rng = np.random.default_rng(0)
    special = np.array(
        [
            0.0,
            -0.0,
            np.inf,
            -np.inf,
            65504.0,
            65519.99,
            65520.0,
            1e-8,
            -6e-8,
            5.96e-8,
            2.98e-8,
            6.1e-5,
            3.0e38,
            1.0 + 2**-8,
            1.0 + 3 * 2**-8,
        ],
        np.float32,
    )
    bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    values = np.concatenate(
        [
            special,
            bits.view(np.float32),
            rng.normal(size=10_000).astype(np.float32) * np.float32(1e-5),
        ]
    )
    values = values[~np.isnan(values)]
    got = np.frombuffer(_native.module().round_trip(dtype, values.tobytes()), np.float32)
    with np.errstate(over="ignore"):  # float16 overflow to inf is the expected result
        want = values.astype(getattr(ml_dtypes, dtype) if dtype == "bfloat16" else np.float16)
    want = want.astype(np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
