"""Peak RSS of one pp=2 stage worker next to the full model's weight bytes: the worker layer's measurement
(``packages/worker/benchmarks/stage_memory.py``), run as a script in this venv, its JSON kept as the section's
figures. The measurement lives there, once; this section only passes the report's repeats.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from pipejax_benchmarks.sections.common import RUNNER_BENCHMARKS, section_main

STAGE_MEMORY = RUNNER_BENCHMARKS.parents[1] / "worker" / "benchmarks" / "stage_memory.py"


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="pipejax-memory-") as tmp:
        out = Path(tmp) / "stage_memory.json"
        cmd = [sys.executable, str(STAGE_MEMORY), "--json", str(out), "--repeats", str(args.repeats)]
        subprocess.run(cmd, check=True, timeout=3600)
        return json.loads(out.read_text())


if __name__ == "__main__":
    section_main(run, __doc__)
