"""`python -m jax_hybridep.bench`: fake CPU devices are created before jax starts its backends."""

import os
import sys


def _cpu_devices(argv) -> int:
    """The fake CPU device count: --devices, else the preset's (tiny 4, cpu 8)."""
    count, preset = None, "cpu"
    for i, arg in enumerate(argv):
        value = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
        if arg.startswith("--devices"):
            count = int(value) if value.isdigit() and int(value) > 0 else None  # argparse reports
        elif arg.startswith("--preset"):
            preset = value
    return count or {"tiny": 4}.get(preset, 8)


if "-h" not in sys.argv and "--help" not in sys.argv:
    import jax

    if os.environ.get("JAX_PLATFORMS", "") in ("", "cpu"):
        jax.config.update("jax_num_cpu_devices", _cpu_devices(sys.argv[1:]))

from jax_hybridep.bench.main import main  # noqa: E402

main()
