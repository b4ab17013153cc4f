"""The GPU checks' benches of transport v2, checked without a GPU: the bandwidths derived from the
hooks' timings (jax_hybridep.bench.gpu_transport, v2 and C_sm) and the JAX-level bench's ffi-v1 /
ffi-v2 backends (jax_hybridep.bench), so a lease never finds them broken. The timings themselves
are owed to scripts/gpu_check.sh."""

from __future__ import annotations

import pytest

from jax_hybridep.bench import gpu_transport, runner
from jax_hybridep.bench import main as bench_main


def test_v2_bandwidths_from_the_hook():
    raw = dict(sms=[1, 8], send_us=[1000.0, 125.0], permute_us=[50.0, 50.0],
               fp8_send_us=[800.0, 100.0], fp8_permute_us=[60.0, 60.0],
               unpermute_us=[70.0, 70.0], combine_send_us=[1000.0, 125.0],
               reduce_us=[30.0, 30.0], layout_us=20.0, copy_us=500.0, copy_bytes=1 << 30,
               rows=4096 * 8, row_bytes=7168 * 2, fp8_row_bytes=7392, tokens=4096, stages=12,
               smem_bytes=176128)  # fmt: skip
    result = gpu_transport.measure_v2(raw=raw)
    payload = 4096 * 7168 * 2
    one, eight = result["per_sms"]
    assert one["send_gbps"] == pytest.approx(payload / 1000 / 1e3)
    assert eight["send_gbps"] == pytest.approx(8 * one["send_gbps"])
    assert eight["dispatch_gbps"] == pytest.approx(payload / 175 / 1e3)
    assert eight["permute_hbm_gbps"] == pytest.approx(9 * payload / 50 / 1e3)
    assert eight["fp8_send_wire_gbps"] == pytest.approx(4096 * 7392 / 100 / 1e3)
    assert result["copy_hbm_gbps"] == pytest.approx(2 * (1 << 30) / 500 / 1e3)
    text = gpu_transport.table_v2(result)
    assert "12 stages" in text and len(text.splitlines()) == 6


def test_copy_ceiling_per_sm():
    raw = dict(blocks=[1, 8], lsu_us=[4000.0, 500.0], bulk_us=[2000.0, 250.0], bytes=1 << 28)
    result = gpu_transport.measure_copy_ceiling(raw=raw)
    lsu1, lsu8 = (row["lsu_gbps_per_sm"] for row in result["per_blocks"])
    assert lsu1 == pytest.approx((1 << 28) / 4000 / 1e3) and lsu8 == pytest.approx(lsu1)
    assert result["per_blocks"][0]["bulk_gbps_per_sm"] == pytest.approx(2 * lsu1)
    assert "16-byte LSU" in gpu_transport.table_copy_ceiling(result)


def test_jax_bench_names_the_gpu_transport():
    assert runner.backend_config("ffi") == dict(backend="ffi")
    assert runner.backend_config("ffi-v2") == dict(backend="ffi", gpu_transport="v2")
    assert runner.backend_config("xla") == dict(backend="xla")
    args = bench_main.parser().parse_args(["--backends", "ffi-v1,ffi-v2,xla"])
    assert args.backends == ["ffi-v1", "ffi-v2", "xla"]
    with pytest.raises(SystemExit):
        bench_main.parser().parse_args(["--backends", "ffi-v3"])
