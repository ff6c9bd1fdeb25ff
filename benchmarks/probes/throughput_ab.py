"""pipejax's own output tokens/s, two versions side by side: the throughput section's workload (64 requests x 128
in x 64 out, ``LLM(model)``'s defaults, greedy unless ``--sampled``) on two sides, each in a fresh process, the
processes alternating. A side is a source tree (another checkout's ``packages/*/src`` put ahead of the installed
packages, e.g. ``git worktree add /tmp/before HEAD~1``; default: what is installed) and engine arguments (JSON).

    python benchmarks/probes/throughput_ab.py --a-tree /tmp/before [--rounds 3] [--runs 3]
    python benchmarks/probes/throughput_ab.py --b-args '{"max_num_batched_tokens": 512}'
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = """
import json, os, sys
sys.path.insert(0, {bench!r})
from pipejax_benchmarks.sections.common import NUM_PROMPTS, OUTPUT_LEN
from pipejax_benchmarks.sections.throughput import PipejaxSide
from pipejax.runner.builtin_model import cache_dir_from_env, ensure_builtin_model
import pipejax.runner.runner as runner
side = PipejaxSide(str(ensure_builtin_model("bench", cache_dir_from_env(os.environ))), [NUM_PROMPTS],
                   engine_args=json.loads({args!r}) or None)
tps = [NUM_PROMPTS * OUTPUT_LEN / side.run(NUM_PROMPTS, greedy={greedy})["seconds"] for _ in range({runs})]
side.close()
print("RESULT", json.dumps({{"tps": tps, "runner": runner.__file__}}))
"""


def run_side(tree: str | None, engine_args: str, runs: int, greedy: bool) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "RAY_AUTH_MODE": "disabled"}
    env.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    if tree:
        env["PYTHONPATH"] = os.pathsep.join(sorted(glob.glob(os.path.join(tree, "packages", "*", "src"))))
    code = CHILD.format(bench=os.path.dirname(HERE), args=engine_args, greedy=greedy, runs=runs)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1800)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"a side failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a-tree", default=None, help="side A's checkout (default: the installed packages)")
    parser.add_argument("--b-tree", default=None, help="side B's checkout (default: the installed packages)")
    parser.add_argument("--a-args", default="{}", help="side A's engine arguments, JSON")
    parser.add_argument("--b-args", default="{}", help="side B's engine arguments, JSON")
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per side, alternating")
    parser.add_argument("--runs", type=int, default=3, help="timed runs per process (after its warm-up runs)")
    parser.add_argument("--sampled", action="store_true", help="temperature 1 instead of greedy")
    args = parser.parse_args()
    sides = {"A": (args.a_tree, args.a_args), "B": (args.b_tree, args.b_args)}
    tps: dict[str, list[float]] = {"A": [], "B": []}
    for r in range(args.rounds):
        for name, (tree, engine_args) in sides.items():
            result = run_side(tree, engine_args, args.runs, not args.sampled)
            tps[name] += result["tps"]
            print(f"round {r + 1} {name}: {', '.join(f'{t:.1f}' for t in result['tps'])} tok/s "
                  f"({result['runner']})", flush=True)
    for name, values in tps.items():
        print(f"{name}: median {statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}] tok/s")
    print(f"B / A: {statistics.median(tps['B']) / statistics.median(tps['A']):.3f}")


if __name__ == "__main__":
    main()
