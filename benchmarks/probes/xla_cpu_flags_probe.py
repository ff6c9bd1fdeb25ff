"""Do XLA:CPU's library-fusion flags of jaxlib 0.10.2 speed up the fp32 dots of the benchmark model?

Each flag setting runs in a fresh process (XLA reads XLA_FLAGS once), the settings alternated over
``--rounds``; each line is the GFLOP/s of a jitted ``x @ y`` (median of 9 calls) at the shapes the runner's
steps use: the 2048^3 reference of the floors, the decode step's 64-row and 1-row weight matmuls, and a
2048-token prefill matmul.

    python benchmarks/probes/xla_cpu_flags_probe.py [--rounds 2]

The flag names and values are the ones jaxlib 0.10.2 accepts (its binaries list them; a wrong value is a
fatal error at import). Measured 2026-12-01 14:20 UTC, 2 rounds on a noisy 2-CPU machine: no setting beat the
no-flag runs in both rounds at any shape (no flag: 2048^3 183-186, 64x768x2048 154-174, 64x2048x768 124-143,
1x768x2048 17-26 GFLOP/s; the flagged settings 157-199, 90-166, 81-168, 10-30), so none was adopted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

RUNNER_BENCHMARKS = Path(__file__).resolve().parents[2] / "packages" / "runner" / "benchmarks"

SETTINGS = [
    "",
    "--xla_cpu_use_xnnpack=true",
    "--xla_cpu_experimental_xnn_fusion_type=INDIVIDUAL_DOT",
    "--xla_cpu_experimental_xnn_fusion_type=DOT",
    "--xla_cpu_experimental_ynn_fusion_type=INDIVIDUAL_DOT",
    "--xla_cpu_experimental_ynn_fusion_type=DOT",
    "--xla_cpu_use_onednn=true",
    "--xla_cpu_experimental_onednn_fusion_type=DOT",
]
SHAPES = [(2048, 2048, 2048), (64, 768, 2048), (64, 2048, 768), (1, 768, 2048), (2048, 768, 2048)]


def probe() -> None:
    """One setting, in this process: the GFLOP/s of each shape."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    sys.path.insert(0, str(RUNNER_BENCHMARKS))  # the runner's benchmark helpers: the timer
    from machine_floor import timed

    rng = np.random.default_rng(0)
    matmul = jax.jit(lambda x, y: x @ y)
    out = []
    for m, k, n in SHAPES:
        x = jnp.asarray(rng.standard_normal((m, k), np.float32))
        y = jnp.asarray(rng.standard_normal((k, n), np.float32))
        median = statistics.median(timed(lambda x=x, y=y: matmul(x, y).block_until_ready(), 9))
        out.append(f"{m}x{k}x{n} {2 * m * k * n / median / 1e9:4.0f}")
    print(" | ".join(out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.probe:
        probe()
        return
    print("GFLOP/s of fp32 x @ y per XLA_FLAGS setting, each in a fresh process")
    for _ in range(args.rounds):
        for flags in SETTINGS:
            env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}
            proc = subprocess.run([sys.executable, __file__, "--probe"], env=env, capture_output=True, text=True,
                                  timeout=300)
            line = proc.stdout.strip() or f"failed: {proc.stderr.strip().splitlines()[-1:]}"
            print(f"{flags or '(no flag)':55s} {line}", flush=True)


if __name__ == "__main__":
    main()
