"""`python -m lab.xdc_paper [--json FILE] [--strict]`: the paper's tables reproduced by
the cost model (`tables`) and the reproduction's pass / fail tiers (`reproduction`)."""

from __future__ import annotations

import argparse
import json
import sys

from jax_hybridep.values import make_parent_dirs, output_path_arg, run_command
from lab.xdc_paper import reproduction


def main(argv=None) -> dict:
    """`python -m lab.xdc_paper [--json FILE] [--strict]`: the tables and the tiers."""
    parser = argparse.ArgumentParser(
        prog="python -m lab.xdc_paper",
        description="The HybridEP paper's tables reproduced by the cost model, and the pass / "
        "fail tiers of the reproduction.",
    )
    parser.add_argument(
        "--json", type=output_path_arg, default="", help="write every Table V point and the tiers"
    )
    parser.add_argument("--strict", action="store_true", help="exit 1 if a tier fails")
    args = parser.parse_args(argv)
    report = reproduction.report()
    print(reproduction.markdown())
    print("\n" + reproduction.summary(report["tiers"]))
    if args.json:
        make_parent_dirs(args.json)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}")
    if args.strict and not all(t["pass"] for t in report["tiers"]):
        sys.exit(1)
    return report


if __name__ == "__main__":
    run_command(main, "python -m lab.xdc_paper")
