"""The decode step against this machine's floor, part by part: the runner layer's measurement
(``packages/runner/benchmarks/decode_floor.py``), run as a script in this venv, its JSON kept as the section's
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

DECODE_FLOOR = RUNNER_BENCHMARKS / "decode_floor.py"


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="pipejax-decode-") as tmp:
        out = Path(tmp) / "decode_floor.json"
        cmd = [sys.executable, str(DECODE_FLOOR), "--json", str(out), "--repeats", str(args.repeats)]
        subprocess.run(cmd + (["--quick"] if args.quick else []), check=True, timeout=3600)
        return json.loads(out.read_text())


if __name__ == "__main__":
    section_main(run, __doc__)
