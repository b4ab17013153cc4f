"""`python -m jax_hybridep.bench.gpu_transport`: the CUDA transport of one rank alone, per SM count.

One rank sends to its own registered window, so every byte goes through HBM: this measures the
kernels' rate (what could fill an NVLink direction) without peers. Per SM count (blocks per
transport kernel): dispatch (send + receive-and-expand) and combine (partials + reduce) in payload
bandwidth as Hybrid-EP defines it (received unique tokens x H x bytes / time, self traffic
included), and FP8 dispatch (quantised in the send kernel, dequantised in the receive) in the
same payload units and in wire bytes (e4m3fn payload + scales), beside the layout handler's kernels
(plan and assign over the gathered counts) and a device-to-device copy measured in the same run.
Needs a GPU and a CUDA build.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import shutil
import subprocess

from jax_hybridep import _native
from jax_hybridep.bench import cli, report

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def gpu_name() -> str:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "unknown GPU"
    out = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                         text=True, check=False)  # fmt: skip
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else "unknown GPU"


def measure(dtype="bfloat16", tokens=4096, hidden=7168, k=8, experts=8, sms=(1, 2, 4, 8, 16, 24),
            iters=20, warmup=3) -> dict:  # fmt: skip
    """Runs the hook and derives bandwidths (GB/s = 1e9 bytes/s)."""
    raw = _native.testing_module().cuda_bench_transport(
        dtype, tokens, hidden, k, experts, list(sms), iters=iters, warmup=warmup
    )
    payload = tokens * hidden * DTYPE_BYTES[dtype]  # unique tokens received (all local here)
    rows_bytes = raw["rows"] * raw["row_bytes"]
    copy_gbps = 2 * raw["copy_bytes"] / raw["copy_us"] / 1e3  # read + write
    per_sms = []
    for i, n in enumerate(raw["sms"]):
        send, receive = raw["dispatch_send_us"][i], raw["dispatch_receive_us"][i]
        partials, reduce = raw["combine_send_us"][i], raw["combine_reduce_us"][i]
        fp8_send, fp8_receive = raw["fp8_send_us"][i], raw["fp8_receive_us"][i]
        # The receive reads the payload, zeroes and writes the rows: its HBM traffic.
        permute_gbps = (payload + 2 * rows_bytes) / receive / 1e3
        per_sms.append(
            dict(
                sms=n,
                dispatch_gbps=payload / (send + receive) / 1e3,
                combine_gbps=payload / (partials + reduce) / 1e3,
                dispatch_send_gbps=payload / send / 1e3,
                fp8_dispatch_gbps=payload / (fp8_send + fp8_receive) / 1e3,
                fp8_send_gbps=payload / fp8_send / 1e3,
                fp8_send_wire_gbps=tokens * raw["fp8_row_bytes"] / fp8_send / 1e3,
                permute_hbm_gbps=permute_gbps,
                permute_vs_copy=permute_gbps / copy_gbps,
                **{
                    key: raw[key][i]
                    for key in (
                        "dispatch_send_us",
                        "dispatch_receive_us",
                        "combine_send_us",
                        "combine_reduce_us",
                        "fp8_send_us",
                        "fp8_receive_us",
                    )
                },  # fmt: skip
            )
        )
    layout_gbps = (2 * tokens * k * 4) / raw["layout_us"] / 1e3  # ids read, rows written
    return dict(
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        machine=f"{gpu_name()}, {platform.node()}",
        workload=dict(dtype=dtype, tokens=tokens, hidden=hidden, k=k, experts=experts),
        copy_hbm_gbps=copy_gbps,
        layout_us=raw["layout_us"],
        layout_gbps=layout_gbps,
        per_sms=per_sms,
    )


def table(result: dict) -> str:
    lines = [
        f"{result['machine']}  {result['date']}  {result['workload']}",
        f"HBM copy (read+write): {result['copy_hbm_gbps']:.0f} GB/s;  layout: "
        f"{result['layout_us']:.1f} us ({result['layout_gbps']:.0f} GB/s of ids and rows)",
        f"{'SMs':>4} {'dispatch GB/s':>14} {'combine GB/s':>13} {'send GB/s':>10} "
        f"{'permute GB/s':>13} {'permute/copy':>13} {'fp8 dispatch':>13} "
        f"{'fp8 send (wire)':>16}",
    ]
    for row in result["per_sms"]:
        fp8_send = f"{row['fp8_send_gbps']:.0f} ({row['fp8_send_wire_gbps']:.0f})"
        lines.append(
            f"{row['sms']:>4} {row['dispatch_gbps']:>14.0f} {row['combine_gbps']:>13.0f} "
            f"{row['dispatch_send_gbps']:>10.0f} {row['permute_hbm_gbps']:>13.0f} "
            f"{row['permute_vs_copy']:>13.2f} {row['fp8_dispatch_gbps']:>13.0f} {fp8_send:>16}"
        )
    lines.append("GB/s of 16-bit payload (tokens x H x bytes); fp8 send (wire): of e4m3fn + scales")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES))
    p.add_argument("--tokens", type=cli.positive_int, default=4096)
    p.add_argument("--hidden", type=cli.positive_int, default=7168)
    p.add_argument("--k", type=cli.positive_int, default=8)
    p.add_argument("--experts", type=cli.positive_int, default=8)
    p.add_argument("--sms", type=cli.positive_int_list, default=[1, 2, 4, 8, 16, 24],
                   help="comma-separated SM counts")  # fmt: skip
    p.add_argument("--iters", type=cli.positive_int, default=20)
    p.add_argument("--warmup", type=cli.nonnegative_int, default=3)
    p.add_argument("--json", type=cli.output_path, default="gpu_transport.json",
                   help="JSON output ('' to skip)")  # fmt: skip
    args = p.parse_args(argv)
    result = measure(args.dtype, args.tokens, args.hidden, args.k, args.experts,
                     args.sms, args.iters, args.warmup)  # fmt: skip
    if args.json:
        report.write_json(result, args.json)
    print(table(result))
    return result


if __name__ == "__main__":
    main()
