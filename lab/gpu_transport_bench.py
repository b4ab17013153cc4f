"""`python -m lab.gpu_transport_bench`: the CUDA transport of one rank alone, per SM.

One rank sends to its own registered window, so every byte goes through HBM: this measures the
kernels' rate (what could fill an NVLink direction) without peers. Per SM count (blocks of the
send kernels): the send, FP8 send and combine's send back, and the wide permute, unpermute and
reduce (every SM), against a device-to-device copy measured in the same run, in payload bandwidth
as Hybrid-EP defines it (received unique tokens x H x bytes / time, self traffic included); the
rows are checked against the references first. `--copy_ceiling`: C_sm instead, what 1 and 8
SMs copy by 16-byte LSU accesses and by the bulk-copy engine (the per-SM ceiling the send is built
on). Needs a GPU and a CUDA build with the test module (its hooks time the kernels:
lab/native/cuda/bench_hooks.cc); run from the repository root.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import shutil
import subprocess

from jax_hybridep.bench import cli, report
from lab import native_module

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def gpu_name() -> str:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "unknown GPU"
    out = subprocess.run(
        [smi, "--query-gpu=name", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=False,
    )
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else "unknown GPU"


def measure(
    dtype="bfloat16",
    tokens=4096,
    hidden=7168,
    k=8,
    experts=8,
    sms=(1, 2, 4, 8, 16, 24),
    iters=20,
    warmup=3,
    raw=None,
) -> dict:
    """Runs the transport's hook (or derives from `raw`, its result) into GB/s (1e9 bytes/s)."""
    if raw is None:
        raw = native_module.testing_module().cuda_bench_transport(
            dtype, tokens, hidden, k, experts, list(sms), iters=iters, warmup=warmup
        )
    payload = tokens * hidden * DTYPE_BYTES[dtype]  # unique tokens received (all local here)
    rows_bytes = raw["rows"] * raw["row_bytes"]
    copy_gbps = 2 * raw["copy_bytes"] / raw["copy_us"] / 1e3  # read + write

    def gbps(num_bytes, us):
        return num_bytes / us / 1e3

    per_sms = []
    for i, n in enumerate(raw["sms"]):
        send, permute = raw["send_us"][i], raw["permute_us"][i]
        fp8_send, fp8_permute = raw["fp8_send_us"][i], raw["fp8_permute_us"][i]
        unpermute, back, reduce = (
            raw[key][i] for key in ("unpermute_us", "combine_send_us", "reduce_us")
        )
        # HBM traffic of the wide kernels: the permute reads the payload once and writes every
        # row; the unpermute reads every row and writes one partial per token; the reduce reads
        # and writes one row per token.
        permute_gbps = gbps(payload + rows_bytes, permute)
        per_sms.append(
            dict(
                sms=n,
                send_gbps=gbps(payload, send),
                dispatch_gbps=gbps(payload, send + permute),
                combine_send_gbps=gbps(payload, back),
                combine_gbps=gbps(payload, unpermute + back + reduce),
                fp8_send_gbps=gbps(payload, fp8_send),
                fp8_send_wire_gbps=gbps(tokens * raw["fp8_row_bytes"], fp8_send),
                fp8_dispatch_gbps=gbps(payload, fp8_send + fp8_permute),
                permute_hbm_gbps=permute_gbps,
                permute_vs_copy=permute_gbps / copy_gbps,
                unpermute_hbm_gbps=gbps(rows_bytes + payload, unpermute),
                reduce_hbm_gbps=gbps(2 * payload, reduce),
                send_vs_copy=gbps(2 * payload, send) / copy_gbps,
                **{
                    key: raw[key][i]
                    for key in (
                        "send_us",
                        "permute_us",
                        "fp8_send_us",
                        "fp8_permute_us",
                        "unpermute_us",
                        "combine_send_us",
                        "reduce_us",
                    )
                },
            )
        )
    return dict(
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        machine=f"{gpu_name()}, {platform.node()}",
        workload=dict(dtype=dtype, tokens=tokens, hidden=hidden, k=k, experts=experts),
        send_stages=raw["stages"],
        send_smem_bytes=raw["smem_bytes"],
        copy_hbm_gbps=copy_gbps,
        layout_us=raw["layout_us"],
        per_sms=per_sms,
    )


def table(result: dict) -> str:
    lines = [
        f"{result['machine']}  {result['date']}  {result['workload']}",
        f"HBM copy (read+write): {result['copy_hbm_gbps']:.0f} GB/s;  slot map: "
        f"{result['layout_us']:.1f} us;  send: {result['send_stages']} stages, "
        f"{result['send_smem_bytes'] / 1024:.0f} KiB shared",
        f"{'SMs':>4} {'send':>7} {'dispatch':>9} {'combine':>8} {'c.send':>7} "
        f"{'permute':>8} {'perm/copy':>10} {'unperm':>7} {'reduce':>7} {'fp8 send (wire)':>16}",
    ]
    for row in result["per_sms"]:
        fp8 = f"{row['fp8_send_gbps']:.0f} ({row['fp8_send_wire_gbps']:.0f})"
        lines.append(
            f"{row['sms']:>4} {row['send_gbps']:>7.0f} {row['dispatch_gbps']:>9.0f} "
            f"{row['combine_gbps']:>8.0f} {row['combine_send_gbps']:>7.0f} "
            f"{row['permute_hbm_gbps']:>8.0f} {row['permute_vs_copy']:>10.2f} "
            f"{row['unpermute_hbm_gbps']:>7.0f} {row['reduce_hbm_gbps']:>7.0f} {fp8:>16}"
        )
    lines.append(
        "GB/s of 16-bit payload (send, dispatch, combine, c.send = combine's send back); "
        "permute/unperm/reduce: HBM bytes moved"
    )
    return "\n".join(lines)


def measure_copy_ceiling(copy_bytes=1 << 28, blocks=(1, 8), iters=10, warmup=2, raw=None):
    """C_sm: GB/s (payload copied, and read + write) per block count, LSU and bulk copies."""
    if raw is None:
        raw = native_module.testing_module().cuda_bench_copy_ceiling(
            copy_bytes, list(blocks), iters=iters, warmup=warmup
        )
    rows = []
    for i, n in enumerate(raw["blocks"]):
        lsu, bulk = raw["lsu_us"][i], raw["bulk_us"][i]
        rows.append(
            dict(
                blocks=n,
                lsu_us=lsu,
                bulk_us=bulk,
                lsu_gbps_per_sm=raw["bytes"] / lsu / 1e3 / n,
                bulk_gbps_per_sm=raw["bytes"] / bulk / 1e3 / n,
            )
        )
    return dict(
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        machine=f"{gpu_name()}, {platform.node()}",
        copy_bytes=raw["bytes"],
        per_blocks=rows,
    )


def table_copy_ceiling(result: dict) -> str:
    lines = [
        f"{result['machine']}  {result['date']}  C_sm: copy of "
        f"{result['copy_bytes'] / 2**20:.0f} MiB, GB/s of payload per SM",
        f"{'SMs':>4} {'16-byte LSU':>12} {'bulk copy':>10}",
    ]
    for row in result["per_blocks"]:
        lines.append(
            f"{row['blocks']:>4} {row['lsu_gbps_per_sm']:>12.1f} {row['bulk_gbps_per_sm']:>10.1f}"
        )
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--copy_ceiling", action="store_true", help="measure C_sm (the copy ceiling per SM) instead"
    )
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES))
    p.add_argument("--tokens", type=cli.positive_int, default=4096)
    p.add_argument("--hidden", type=cli.positive_int, default=7168)
    p.add_argument("--k", type=cli.positive_int, default=8)
    p.add_argument("--experts", type=cli.positive_int, default=8)
    p.add_argument(
        "--sms",
        type=cli.positive_int_list,
        default=[1, 2, 4, 8, 16, 24],
        help="comma-separated SM counts",
    )
    p.add_argument("--iters", type=cli.positive_int, default=20)
    p.add_argument("--warmup", type=cli.nonnegative_int, default=3)
    p.add_argument(
        "--json",
        type=cli.output_path,
        default="gpu_transport.json",
        help="JSON output ('' to skip)",
    )
    args = p.parse_args(argv)
    if args.copy_ceiling:
        result = measure_copy_ceiling(blocks=args.sms, iters=args.iters, warmup=args.warmup)
        text = table_copy_ceiling(result)
    else:
        result = measure(
            args.dtype,
            args.tokens,
            args.hidden,
            args.k,
            args.experts,
            args.sms,
            args.iters,
            args.warmup,
        )
        text = table(result)
    if args.json:
        report.write_json(result, args.json)
    print(text)
    return result


if __name__ == "__main__":
    main()
