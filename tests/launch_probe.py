"""A stand-in for the main job under scripts/launch_local.sh (tests/train_mp_test.py runs it as
`MODULE=launch_probe`, tests/ on PYTHONPATH): no jax.

Records its pid and flags in <output_dir>/probe_<process_id>.json, then process 1 exits with
status 3 at once while the others sleep (the launcher must stop them and exit 3).
"""

import json
import os
import sys
import time

flags = dict(a.removeprefix("--").split("=", 1) for a in sys.argv[1:] if "=" in a)
with open(os.path.join(flags["output_dir"], f"probe_{flags['process_id']}.json"), "w") as f:
    json.dump(dict(pid=os.getpid(), flags=flags), f)
if flags["process_id"] == "1":
    time.sleep(0.5)
    sys.exit(3)
time.sleep(120)
