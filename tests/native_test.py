"""The native modules: the production module registers handlers only, the laboratory's test module
(outside the package) holds the rest; and the float conversions the CPU kernels rely on."""

import importlib.util

import ml_dtypes
import numpy as np
import pytest

import jax_hybridep as hep
from jax_hybridep import _native
from jax_hybridep.exchange import cuda
from lab import native_module


def test_handlers_registered():
    targets = set(_native.module().cpu_registrations())
    one_level = {
        "layout",
        "layout_gathered",
        "dispatch",
        "combine_vjp",
        "combine",
        "return_row_values",
        "fp8_quantize",
    }
    per_level = {
        "level_send",
        "level_pack",
        "expand_items",
        "expand_items_vjp",
        "item_partials",
        "blocks_all_to_all",
        "level_reduce",
        "level_reduce_pull",
        "level_pick",
    }
    assert targets == {f"jax_hybridep_{name}" for name in one_level | per_level}


# What the production module may hold besides handler registrations: the runtime services the
# package's own Python calls (jax_hybridep/_native.py, errors.py). Anything else belongs in the
# test module.
PRODUCTION_SERVICES = {
    "with_cuda": "which platforms have handlers (_native.platforms)",
    "take_recorded_errors": "hep.check_errors() raises what the handlers recorded",
    "cuda_window_error": "hep.check_errors() raises a GPU transport's device-side failure",
    "set_kv_exchange": "window handles of multi-process EP groups travel through jax.distributed",
    "release_cuda_windows": "the windows are freed at exit, before the CUDA runtime goes",
    "limits": "the kernels' limits (num_sms, top-k, chunk), asked for rather than copied",
    "send_plan": "the send kernel's shared-memory plan (whether FP8 tokens fit), asked for",
}


def test_production_module_registers_handlers_only():
    production = _native.module()
    names = {n for n in dir(production) if not n.startswith("__")}
    registrations = {n for n in names if n.endswith("_registrations")}
    cuda = {"cuda_registrations", "cuda_state_type_registrations"}  # the handlers, their state
    assert registrations == {"cpu_registrations"} | (cuda if production.with_cuda else set())
    cuda_only = {"cuda_window_error", "set_kv_exchange", "release_cuda_windows"}
    services = set(PRODUCTION_SERVICES) - (set() if production.with_cuda else cuda_only)
    assert names - registrations == services
    # The test hooks are in the test module, on the same runtime.
    testing = native_module.testing_module()
    assert testing.with_cuda == production.with_cuda
    assert {"round_trip", "open_exchange_count", "transport_reference"} <= set(dir(testing))
    if production.with_cuda:
        assert {"cuda_selftest_transport", "cuda_bench_transport"} <= set(dir(testing))


def test_the_test_module_stands_outside_the_package():
    """The test module is the laboratory's (lab/native/): a top-level module of the developer
    install, never a part of jax_hybridep, so no wheel a user installs carries it."""
    assert native_module.testing_module().__name__ == "_hybridep_testing"
    assert importlib.util.find_spec("jax_hybridep._hybridep_testing") is None


def test_both_modules_share_one_runtime():
    """One runtime library under both modules (not a copy each): a failure recorded through the
    test module is the one the production module's error log hands hep.check_errors()."""
    native_module.testing_module().record_transport_error(
        "jax_hybridep: probe of the shared runtime"
    )
    assert _native.module().take_recorded_errors() == [
        ("transport", "jax_hybridep: probe of the shared runtime")
    ]


def test_python_asks_the_native_module_for_its_limits():
    """No kernel constant is copied in Python: the config's num_sms bound, the transport's top-k
    limit and chunk padding come from the production module (the send plan:
    tests/send_plan_test.py)."""
    limits = _native.module().limits()
    assert _native.limits() == limits
    most = limits["max_send_blocks"]
    assert hep.DispatchConfig(num_experts=8, num_sms=most).num_sms == most
    with pytest.raises(ValueError, match=rf"num_sms must be an int in \[1, {most}\]"):
        hep.DispatchConfig(num_experts=8, num_sms=most + 1)
    chunk = limits["send_chunk"]
    assert cuda.padded(1) == chunk and cuda.padded(chunk + 1) == 2 * chunk
    with pytest.raises(ValueError, match="send_plan: need"):
        _native.module().send_plan(0, 8)


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
    got = np.frombuffer(
        native_module.testing_module().round_trip(dtype, values.tobytes()), np.float32
    )
    with np.errstate(over="ignore"):  # float16 overflow to inf is the expected result
        want = values.astype(getattr(ml_dtypes, dtype) if dtype == "bfloat16" else np.float16)
    want = want.astype(np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
