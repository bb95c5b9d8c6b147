"""`kvtool validate mooncake` against a real Mooncake Store started here (run inside a private
network namespace: see .ci/run). Exits with validate's code."""

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.helpers.servers import MooncakeStore  # noqa: E402

store = MooncakeStore().start()
try:
    options = [a for k, v in store.options.items() for a in ("--connector-opt", f"{k}={v}")]
    sys.exit(subprocess.run([sys.executable, "-m", "kvtool", "validate", "mooncake", *options,
                             "--junit", sys.argv[1]]).returncode)
finally:
    store.stop()
