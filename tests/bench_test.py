"""Smoke test of the benchmark CLI (`python -m jax_hybridep.bench`): the tiny preset in-process on
4 of the test's fake CPU devices. Checks the JSON's fields and values, never timings."""

import json
import math
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from jax_hybridep import level_traffic
from jax_hybridep.bench import main as bench_main
from jax_hybridep.bench import runner, workloads
from lab import gpu_transport_bench, native_module

CASE_FIELDS = (
    "method",
    "backend",
    "label",
    "topology",
    "routing",
    "capacity",
    "variant",
    "zero_padding",
    "wire_dtype",
    "capacity_factor",
    "row_budget_factor",
    "baseline_capacity",
    "direction",
    "median_s",
    "times_s",
    "received_tokens",
    "algo_bw_GBps",
    "level_bytes",
    "level_sends",
    "sent_bytes",
    "buffer_bytes",
    "xla_memory_bytes",
    "dropped",
    "max_rel_err",
    "best_baseline",
    "ratio_to_best_baseline",
    "ratio_to_floor",
)


@pytest.fixture(scope="module")
def doc(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    bench_main.benchmark(
        "tiny",
        jax.devices()[:4],
        routings=("uniform", "skewed"),
        capacities=(None, 1.25, runner.Budget(1.0)),
        repeats=1,
        warmup=0,
        json_path=str(out / "bench.json"),
        png_path=str(out / "bench.png"),
        command="tests/bench_test.py",
        log=lambda _: None,
    )
    assert (out / "bench.png").stat().st_size > 0
    with open(out / "bench.json") as f:
        return json.load(f)


def _pos(v):
    return isinstance(v, int | float) and math.isfinite(v) and v > 0


def test_environment_and_workload(doc):
    env, wl = doc["environment"], doc["workload"]
    assert env["num_devices"] == 4 and env["jax_version"] == jax.__version__
    assert env["date"] and env["command"] and len(env["devices"]) == 4
    assert wl["preset"] == "tiny" and wl["ranks"] == 4 and wl["experts"] == 16


def test_every_case_present(doc):
    labels = {(c["label"], c["capacity"], c["direction"]) for c in doc["cases"]}
    for direction in ("fwd", "fwd+bwd"):
        for cap in ("dropless", "f=1.25"):
            for b in ("ffi", "xla"):
                for topo in ("flat", "hierarchical"):
                    assert (f"hybridep-{b}/{topo}", cap, direction) in labels
        assert ("gshard", "f=1.25", direction) in labels
        assert ("maxtext-padded", "dropless", direction) in labels
        assert ("worst_case", "dropless", direction) in labels
    assert len(doc["cases"]) == 2 * 2 * (4 + 2 + 4 + 1 + 4)  # routings x directions x cases


def test_row_budget_cases(doc):
    """budget=F: dropless with DispatchConfig.row_budget = ceil(F * T * K) rows per rank, timed
    against the dropless baselines; its overflow is counted, and without overflow it is exact."""
    budget = [c for c in doc["cases"] if c["capacity"] == "budget=1"]
    assert len(budget) == 2 * 2 * 4
    rows = 32 * 2  # T * K of the tiny preset
    for c in budget:
        assert c["method"] == "hybridep" and c["baseline_capacity"] == "dropless"
        assert c["row_budget_factor"] == 1.0 and c["buffer_bytes"] == rows * 64 * 4
        assert c["best_baseline"] in ("worst_case", "maxtext-padded")
        if c["dropped"] == 0:
            assert c["max_rel_err"] is not None and c["max_rel_err"] < 1e-5, c
        else:
            assert c["max_rel_err"] is None
    # The skewed routing's hot expert overflows a budget of the average rows per rank.
    assert any(c["dropped"] > 0 for c in budget if c["routing"] == "skewed")
    labels = {(c["label"], c["routing"], c["direction"]) for c in budget}
    drops = {}
    for c in budget:
        drops.setdefault((c["routing"], c["direction"]), set()).add(c["dropped"])
    assert all(len(v) == 1 for v in drops.values()), drops  # same drops on every backend/topology
    assert len(labels) == len(budget)


def test_barrier_variant_and_unzeroed_padding_give_the_same_results():
    """--variants barrier puts an optimization_barrier before combine; --no-zero-padding leaves
    rows past the groups unwritten: values stay correct for both backends."""
    doc = bench_main.benchmark(
        "tiny",
        jax.devices()[:4],
        routings=("skewed",),
        capacities=(None,),
        methods=("hybridep",),
        topologies=("flat",),
        directions=("fwd+bwd",),
        variants=("fusible", "barrier"),
        zero_padding=False,
        repeats=1,
        warmup=0,
        log=lambda _: None,
    )
    labels = {c["label"] for c in doc["cases"]}
    assert labels == {
        f"hybridep-{b}/flat{v}+nozero" for b in ("ffi", "xla") for v in ("", "+barrier")
    }
    assert {c["variant"] for c in doc["cases"]} == {"fusible", "barrier"}
    assert all(c["zero_padding"] is False for c in doc["cases"])
    assert all(c["max_rel_err"] is not None and c["max_rel_err"] < 1e-2 for c in doc["cases"])


def test_fp8_wire_cases_count_wire_bytes():
    """--wire_dtype native,float8_e4m3fn times both side by side; an FP8 copy is counted at
    H + 4 * ceil(H / 128) bytes (the tiny preset is float32: 4 H bytes otherwise)."""
    args = bench_main.parser().parse_args(["--wire_dtype", "native,float8_e4m3fn"])
    assert args.wire_dtype == ["native", "float8_e4m3fn"]
    doc = bench_main.benchmark(
        "tiny",
        jax.devices()[:4],
        routings=("uniform",),
        capacities=(None,),
        methods=("hybridep",),
        topologies=("flat", "hierarchical"),
        directions=("fwd",),
        wire_dtypes=(None, "float8_e4m3fn"),
        repeats=1,
        warmup=0,
        log=lambda _: None,
    )
    cases = {c["label"]: c for c in doc["cases"]}
    hidden = workloads.PRESETS["tiny"].hidden
    for backend in ("ffi", "xla"):
        for topology in ("flat", "hierarchical"):
            native = cases[f"hybridep-{backend}/{topology}"]
            wire = cases[f"hybridep-{backend}/{topology}+fp8"]
            assert wire["wire_dtype"] == "float8_e4m3fn" and native["wire_dtype"] is None
            assert native["level_bytes"].keys() == wire["level_bytes"].keys()
            for level, nbytes in native["level_bytes"].items():
                assert wire["level_bytes"][level] * 4 * hidden == nbytes * (hidden + 4), level
            assert native["max_rel_err"] < 1e-5 and 0 < wire["max_rel_err"] < 0.1


def test_parse_capacities():
    assert bench_main.parse_capacities("dropless, 1.25,budget=1.5") == [
        None,
        1.25,
        runner.Budget(1.5),
    ]


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--capacities", "1.25,abc"], "'abc' in '1.25,abc'"),
        (["--capacities", "budget=-1"], "'budget=-1'"),
        (["--capacities", "inf"], "'inf'"),
        (["--routings", "uniform,zipf"], "unknown ['zipf']"),
        (["--methods", "nccl"], "unknown ['nccl']"),
        (["--backends", "cuda"], "unknown ['cuda']"),
        (["--directions", "bwd"], "unknown ['bwd']"),
        (["--devices", "0"], "'0' is not an int >= 1"),
        (["--repeats", "two"], "'two' is not an int >= 1"),
        (["--warmup", "-1"], "'-1' is not an int >= 0"),
    ],
)
def test_bad_flags_fail_at_parse_time_naming_the_value(capsys, argv, needle):
    with pytest.raises(SystemExit) as info:
        bench_main.parser().parse_args(argv)
    assert info.value.code == 2
    assert needle in capsys.readouterr().err


def test_layer_and_profile_clis_check_their_flags(capsys):
    from jax_hybridep.bench import layer, profile

    for main, argv, needle in [
        (layer.main, ["--tokens", "0"], "'0' is not an int >= 1"),
        (layer.main, ["--capacity_factor", "nan"], "'nan' is not a finite number > 0"),
        (profile.main, ["--capacity", "budget=x"], "--capacity: 'budget=x'"),
        (profile.main, ["--routing", "zipf"], "invalid choice: 'zipf'"),
    ]:
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
        assert needle in capsys.readouterr().err


def test_fields_sane(doc):
    for c in doc["cases"]:
        missing = [k for k in CASE_FIELDS if k not in c]
        assert not missing, (c["label"], missing)
        assert _pos(c["median_s"]) and _pos(c["algo_bw_GBps"]) and _pos(c["buffer_bytes"])
        assert _pos(c["received_tokens"]) and all(_pos(t) for t in c["times_s"])
        assert _pos(c["ratio_to_best_baseline"]) and _pos(c["ratio_to_floor"])
        assert isinstance(c["dropped"], int) and c["dropped"] >= 0
        assert c["level_bytes"] and all(
            isinstance(v, int) and v >= 0 for v in c["level_bytes"].values()
        )
        if c["capacity"] == "dropless":
            assert c["dropped"] == 0, c
    assert len(doc["floors"]) == 4
    for f in doc["floors"]:
        assert _pos(f["median_s"]) and _pos(f["bw_GBps"]) and _pos(f["bytes"])


def test_dropless_methods_agree(doc):
    for c in doc["cases"]:
        if c["capacity"] == "dropless":
            assert c["max_rel_err"] is not None and c["max_rel_err"] < 1e-5, c


def test_traffic_consistent(doc):
    pick = {(c["label"], c["routing"], c["capacity"]): c for c in doc["cases"]}
    for routing in ("uniform", "skewed"):
        flat = pick[("hybridep-ffi/flat", routing, "dropless")]["level_bytes"]
        hier = pick[("hybridep-ffi/hierarchical", routing, "dropless")]["level_bytes"]
        xla = pick[("hybridep-xla/flat", routing, "dropless")]["level_bytes"]
        assert flat == xla
        # On CPU the xla route's levels are padded: (S - 1) * T slots per rank, any routing.
        case = pick[("hybridep-xla/flat", routing, "dropless")]
        preset, ranks = workloads.PRESETS["tiny"], 4
        slot = level_traffic.slot_bytes(preset.hidden, preset.dtype, preset.top_k)
        assert case["level_sends"] == {"ep": "padded"}
        assert case["sent_bytes"] == {"ep": ranks * (ranks - 1) * preset.tokens * slot}
        host = pick[("hybridep-ffi/flat", routing, "dropless")]
        assert host["level_sends"] == {"ep": "copies"} and host["sent_bytes"]["ep"] == flat["ep"]
        assert flat["ep"] == flat["node"] + flat["local"]  # measured == counted from routing
        assert hier["node"] <= flat["node"]  # one copy per (token, destination node)
        assert pick[("worst_case", routing, "dropless")]["level_bytes"]["node"] >= flat["node"]
    # A hot expert over capacity drops rows; GShard and hybridep both count them.
    assert pick[("hybridep-ffi/flat", "skewed", "f=1.25")]["dropped"] > 0
    assert pick[("gshard", "skewed", "f=1.25")]["dropped"] > 0


def test_ratio_of_best_baseline_is_one(doc):
    for c in doc["cases"]:
        if c["method"] != "hybridep" and c["label"] == c["best_baseline"]:
            assert c["ratio_to_best_baseline"] == pytest.approx(1.0)


def test_gpu_preset_refused_on_cpu():
    with pytest.raises(SystemExit, match="GPUs only"):
        bench_main.benchmark("hybridep")


def test_workload_counts():
    wl = workloads.make_inputs(workloads.PRESETS["tiny"], 4, "deepseek")
    assert wl.topk_idx.shape == (4 * 32, 2) and (wl.topk_idx < 16).all()
    assert wl.received_tokens() == wl.presence().sum() <= 4 * 32 * 2


def test_cli_help():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, "-m", "jax_hybridep.bench", "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    )
    assert "--preset" in out.stdout and "--capacities" in out.stdout


def test_profile_labels_name_custom_calls_and_fusions():
    from jax_hybridep.bench import profile

    hlo = """HloModule m
%fused_computation { ROOT %x = f32[] parameter(0) }

ENTRY %main (p: bf16[4,8]) -> f32[4] {
  %p = bf16[4,8]{1,0} parameter(0)
  %ffi_call.1 = (bf16[16,8]{1,0}, f32[16]{0}) custom-call(%p), custom_call_target="jax_hybridep_combine_vjp", api_version=API_VERSION_TYPED_FFI
  %ffi_call.2 = bf16[4,8]{1,0} custom-call(%p), custom_call_target="jax_hybridep_combine"
  %ffi_call.3 = bf16[4,8]{1,0} custom-call(%p), custom_call_target="jax_hybridep_combine"
  ROOT %ynn_fusion = f32[4]{0} fusion(%p), kind=kCustom, calls=%fused_computation
}
"""  # noqa: E501
    labels = profile.op_labels(hlo)
    assert labels == {
        "ffi_call.1": "ffi combine_vjp",
        "ffi_call.2": "ffi combine (ffi_call.2)",
        "ffi_call.3": "ffi combine (ffi_call.3)",
        "ynn_fusion": "xla ynn_fusion f32[4]",
    }


def test_whole_layer_comparison_smoke():
    """bench.layer at a tiny size: every method ran, timed, and computed the layer of the float32
    numpy model."""
    import jax  # noqa: PLC0415

    from jax_hybridep.bench import layer  # noqa: PLC0415

    shape = layer.LayerShape(
        tokens=16, hidden=16, ffn=16, experts_per_device=2, k=2, dtype="float32"
    )
    result = layer.measure(shape, repeats=1, warmup=1, devices=jax.devices()[:4])
    methods = [r["method"] for r in result["rows"]]
    assert methods[:2] == ["hybridep-ffi", "hybridep-xla"] and methods[2].startswith("ragged")
    assert result["reference_loss"] != 0
    for row in result["rows"]:
        assert row["median_ms"] > 0 and row["vs_ragged"] > 0
        assert row["loss_rel_err"] < 1e-4, row


def test_layer_reference_model_is_the_layer():
    """The numpy model against a direct per-(t, k) evaluation."""
    from jax_hybridep.bench import layer  # noqa: PLC0415

    rng = np.random.default_rng(3)
    x, idx, w, experts, proj = layer._inputs(
        layer.LayerShape(tokens=6, hidden=5, ffn=4, experts_per_device=3, k=2), 2
    )
    ct = rng.standard_normal((x.shape[0], proj.shape[1])).astype(np.float32)
    direct = sum(
        w[t, k] * float(layer._gelu(x[t] @ experts[idx[t, k]]) @ proj @ ct[t])
        for t in range(x.shape[0])
        for k in range(idx.shape[1])
    )
    assert layer.reference_loss(x, idx, w, experts, proj, ct) == pytest.approx(direct, rel=1e-5)


def test_gpu_transport_bandwidths_from_the_hook(monkeypatch, tmp_path):
    """The GPU transport bench's arithmetic (the hook itself needs a GPU; the timings are owed to
    scripts/gpu_check.sh), through its command line: payload GB/s of the send, dispatch and
    combine, HBM GB/s of the wide kernels, FP8 send in wire bytes."""
    raw = dict(
        sms=[1, 8],
        send_us=[1000.0, 125.0],
        permute_us=[50.0, 50.0],
        fp8_send_us=[800.0, 100.0],
        fp8_permute_us=[60.0, 60.0],
        unpermute_us=[70.0, 70.0],
        combine_send_us=[1000.0, 125.0],
        reduce_us=[30.0, 30.0],
        layout_us=20.0,
        copy_us=500.0,
        copy_bytes=1 << 30,
        rows=4096 * 8,
        row_bytes=7168 * 2,
        fp8_row_bytes=7392,
        tokens=4096,
        stages=12,
        smem_bytes=176128,
    )

    class Hook:
        def cuda_bench_transport(self, *args, **kwargs):
            return raw

    monkeypatch.setattr(native_module, "testing_module", lambda: Hook())
    result = gpu_transport_bench.main(["--sms", "1,8", "--json", str(tmp_path / "t.json")])
    payload = 4096 * 7168 * 2
    one, eight = result["per_sms"]
    assert math.isclose(one["send_gbps"], payload / 1000 / 1e3)
    assert math.isclose(eight["send_gbps"], 8 * one["send_gbps"])
    assert math.isclose(eight["dispatch_gbps"], payload / 175 / 1e3)
    assert math.isclose(eight["permute_hbm_gbps"], 9 * payload / 50 / 1e3)
    assert math.isclose(eight["fp8_send_wire_gbps"], 4096 * 7392 / 100 / 1e3)
    assert math.isclose(result["copy_hbm_gbps"], 2 * (1 << 30) / 500 / 1e3)
    text = gpu_transport_bench.table(result)
    assert "12 stages" in text and len(text.splitlines()) == 6
    assert (tmp_path / "t.json").exists()


def test_copy_ceiling_per_sm(monkeypatch):
    raw = dict(blocks=[1, 8], lsu_us=[4000.0, 500.0], bulk_us=[2000.0, 250.0], bytes=1 << 28)

    class Hook:
        def cuda_bench_copy_ceiling(self, *args, **kwargs):
            return raw

    monkeypatch.setattr(native_module, "testing_module", lambda: Hook())
    result = gpu_transport_bench.main(["--copy_ceiling", "--sms", "1,8", "--json", ""])
    lsu1, lsu8 = (row["lsu_gbps_per_sm"] for row in result["per_blocks"])
    assert math.isclose(lsu1, (1 << 28) / 4000 / 1e3) and math.isclose(lsu8, lsu1)
    assert math.isclose(result["per_blocks"][0]["bulk_gbps_per_sm"], 2 * lsu1)
    assert "16-byte LSU" in gpu_transport_bench.table_copy_ceiling(result)


def test_bench_backends_are_the_configs():
    args = bench_main.parser().parse_args(["--backends", "ffi,xla"])
    assert args.backends == ["ffi", "xla"]
    with pytest.raises(SystemExit):
        bench_main.parser().parse_args(["--backends", "ffi-v2"])
