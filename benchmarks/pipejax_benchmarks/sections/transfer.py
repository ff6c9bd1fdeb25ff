"""Cross-process activation transfer next to a raw ZMQ PUSH/PULL of the same bytes: the pp-utils layer's
measurement (``packages/pp-utils/benchmarks/cross_process.py``), run as a script in this venv, its JSON kept as
the section's figures. The measurement lives there, once; this section only sets its rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from pipejax_benchmarks.sections.common import section_main

CROSS_PROCESS = Path(__file__).resolve().parents[3] / "packages" / "pp-utils" / "benchmarks" / "cross_process.py"


def run(args: argparse.Namespace) -> dict[str, Any]:
    rounds = (10 if args.quick else 30) * max(1, args.repeats) // 3
    with tempfile.TemporaryDirectory(prefix="pipejax-transfer-") as tmp:
        out = Path(tmp) / "cross_process.json"
        env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
        subprocess.run([sys.executable, str(CROSS_PROCESS), "--rounds", str(rounds), "--json", str(out)], env=env,
                       check=True, timeout=1200)
        return json.loads(out.read_text())


if __name__ == "__main__":
    section_main(run, __doc__)
