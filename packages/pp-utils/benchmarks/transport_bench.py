"""Activation transport throughput: in-process device_put and cross-process transfer server vs a memory copy.

    .venv/bin/python packages/pp-utils/benchmarks/transport_bench.py [--repeats N] [--json PATH]

Three ways to move one float32 activation [rows, 768] from stage 0 to stage 1, on CPU:
- ``numpy copy``: ``np.copyto`` of the same bytes, the ceiling of this machine's memory bandwidth.
- ``in-process``: ``InProcessTransport`` send + receive, i.e. ``jax.device_put`` from stage 0's
  1-device mesh into stage 1's (another simulated CPU device), until the result is ready.
- ``cross-process``: ``TransferServerTransport`` receive in this process from a stage-0 child process, as
  ``cross_process.py`` (next to this script) measures it, alternated there with a raw ZMQ PUSH/PULL of the
  same bytes (its column here; needs pyzmq) and a bare transfer-server pull: the one cross-process measurement.

Each cell is the median GB/s over the repeats with [min-max]; a warm-up precedes each series.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from cross_process import measure  # noqa: E402  (this folder's; run as a script)

from pipejax.pp_utils import InProcessTransport, IntermediateTensors, stage_meshes  # noqa: E402

HIDDEN = 768
SIZES = {"decode 64x768": 64, "prefill 2048x768": 2048, "large 8192x768": 8192}
WARMUP = 3

def _gbps(nbytes: int, seconds: list[float]) -> tuple[float, float, float]:
    rates = sorted(nbytes / s / 1e9 for s in seconds)
    return float(np.median(rates)), rates[0], rates[-1]


def bench_numpy(rows: int, repeats: int) -> list[float]:
    src = np.random.default_rng(0).standard_normal((rows, HIDDEN), dtype=np.float32)
    dst = np.empty_like(src)
    times = []
    for _ in range(WARMUP + repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return times[WARMUP:]


def bench_in_process(rows: int, repeats: int) -> list[float]:
    mesh0, mesh1 = stage_meshes(jax.devices(), 2, 1)
    x = jax.device_put(np.ones((rows, HIDDEN), np.float32), jax.sharding.NamedSharding(mesh0, jax.P()))
    tensors = IntermediateTensors({"hidden_states": x})
    spec = tensors.spec({"hidden_states": jax.sharding.NamedSharding(mesh1, jax.P())})
    transport = InProcessTransport()
    times = []
    for step in range(WARMUP + repeats):
        start = time.perf_counter()
        transport.send(step, tensors)
        transport.receive(step, spec)["hidden_states"].block_until_ready()
        times.append(time.perf_counter() - start)
    return times[WARMUP:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30, help="timed transfers per cell (default 30)")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()
    repeats = args.repeats

    cross = measure(repeats, SIZES)["sizes"]
    kinds = ("numpy copy", "in-process", "cross-process", "zmq")
    rows_out = []
    for label, rows in SIZES.items():
        nbytes = rows * HIDDEN * 4
        cells = [_gbps(nbytes, bench_numpy(rows, repeats)), _gbps(nbytes, bench_in_process(rows, repeats))]
        cells += [tuple(cross[label]["gbps"][k][s] for s in ("median", "min", "max")) for k in ("transport", "zmq")]
        millis = [nbytes / m / 1e6 for m, _, _ in cells[:2]]
        millis += [cross[label]["latency_ms"][k]["median"] for k in ("transport", "zmq")]
        rows_out.append((label, nbytes, cells, millis))

    print(f"jax {jax.__version__}, {os.cpu_count()} CPUs, float32, median GB/s [min-max] over {repeats} repeats")
    print()
    print("| size | bytes | numpy copy | in-process (device_put) | cross-process (transfer server) | raw ZMQ |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, nbytes, cells, _ in rows_out:
        text = [f"{m:.2f} [{lo:.2f}-{hi:.2f}]" for m, lo, hi in cells]
        print(f"| {label} | {nbytes / 1e6:.2f} MB | " + " | ".join(text) + " |")
    print()
    print("median time per transfer, ms:")
    print()
    print("| size | numpy copy | in-process | cross-process | raw ZMQ |")
    print("|---|---:|---:|---:|---:|")
    for label, _, _, millis in rows_out:
        print(f"| {label} | " + " | ".join(f"{m:.3f}" for m in millis) + " |")
    if args.json:
        figures = {"repeats": repeats, "jax": jax.__version__, "sizes": {
            label: {"bytes": nbytes,
                    "gbps": {k: {"median": m, "min": lo, "max": hi}
                             for k, (m, lo, hi) in zip(kinds, cells, strict=True)},
                    "median_ms": dict(zip(kinds, millis, strict=True))}
            for label, nbytes, cells, millis in rows_out}}
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
