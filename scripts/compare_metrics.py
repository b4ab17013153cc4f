"""Compares the per-step records of main-job runs (metrics.json), timing left out.

    python scripts/compare_metrics.py STEPS REFERENCE.json OTHER.json [...]

Prints, per OTHER, whether its first STEPS training steps (loss, cross-entropy, aux loss, grad
norm, drops, imbalance, level copies) are bit-identical to REFERENCE's, and the first difference.
Exits 1 when any differs. Used to check that a refactor leaves the main job's numbers unchanged.
"""

from __future__ import annotations

import json
import sys


def steps(path: str, count: int) -> list[dict]:
    with open(path) as f:
        rows = json.load(f)["train"][:count]
    return [{k: v for k, v in row.items() if k != "tokens_per_s"} for row in rows]


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    count, reference = int(argv[0]), argv[1]
    want, status = steps(reference, count), 0
    for path in argv[2:]:
        got = steps(path, count)
        same = got == want and len(got) == min(count, len(want))
        print(
            f"{path}: first {count} steps {'bit-identical to' if same else 'DIFFER from'} "
            f"{reference}"
        )
        if not same:
            status = 1
            diff = next(((a, b) for a, b in zip(want, got, strict=False) if a != b), None)
            print(f"  first difference: {diff}")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
