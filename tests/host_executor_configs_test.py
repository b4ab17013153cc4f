"""Every configuration the CUDA handlers accept, on the host executor (docs/host_executor.md),
beside the routings of host_executor_transport_test.py: FP8 on the wire from bfloat16, float16
and float32 tokens; FP8 rows of H % 8 != 0 (the permute's narrow dequantise, a byte at a time)
and of whole 16-byte words; DispatchConfig(zero_padding=False), where the permutes zero only
the rows below each rank's zero line and leave the rest unwritten; more than two SMs a GPU (wider
receive grids, more blocks resident at once); 1-3 send blocks; dropless, capacity and too few
rows. Each round runs the harness of the GPU (lab/native/cuda/harness.cc), rank r on virtual GPU
r, and is held bit for bit against the §2.1 model (tests/transport_helpers.py), FP8 against the
jnp quantisation (docs/design.md §2.1.8). Every output starts as cudaMalloc leaves it, poison
(0xff): rows past a zero line must still hold it, and a kernel reading one is reported.
"""

from __future__ import annotations

import pytest
from host_executor_helpers import Config, check_config, executor, run_config, seeds

pytestmark = pytest.mark.host_executor

CONFIGS = {
    "fp8-bf16-narrow-no-zero-padding": Config("bfloat16", 30, True, "capacity", False, 3, 3, 2),
    "fp8-f16-narrow": Config("float16", 30, True, "dropless", True, 2, 2, 1),
    "fp8-f16-wide-no-zero-padding": Config("float16", 64, True, "tight_rows", False, 2, 4, 3),
    "fp8-f32-narrow-no-zero-padding": Config("float32", 30, True, "capacity", False, 2, 3, 2),
    "fp8-f32-wide": Config("float32", 72, True, "dropless", True, 4, 3, 2, "hot"),
    "f32-bulk-no-zero-padding": Config("float32", 36, False, "capacity", False, 2, 4, 3),
    "bf16-lanes-no-zero-padding": Config("bfloat16", 30, False, "dropless", False, 3, 3, 1),
}


@pytest.fixture(scope="module")
def hx():
    return executor()


@pytest.mark.parametrize(
    "name, seed",
    [(name, seed) for name in CONFIGS for seed in seeds(1)],
    ids=list(CONFIGS),
)
def test_configuration_matches_the_model(hx, name, seed):
    config = CONFIGS[name]
    case, weighted, got = run_config(hx, config, seed)
    check_config(hx, config, case, weighted, got, f"{name} seed {seed} weighted={weighted}")


# The sweep (`sweep` marker, docs/testing.md): every configuration under 12 more seeds, the
# round's values changing with the seed.
SWEEP = [(name, seed) for name in CONFIGS for seed in range(12)]


@pytest.mark.sweep
@pytest.mark.parametrize("name, seed", SWEEP, ids=[f"{n}-seed{s}" for n, s in SWEEP])
def test_configuration_sweep(hx, name, seed):
    config = CONFIGS[name]
    case, weighted, got = run_config(hx, config, 200 + seed, round_seed=seed)
    check_config(hx, config, case, weighted, got, f"{name} seed {200 + seed}")
