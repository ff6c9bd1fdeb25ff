"""Activation transport throughput: in-process device_put and cross-process transfer server vs a memory copy.

    .venv/bin/python packages/pp-utils/benchmarks/transport_bench.py [--repeats N]

Three ways to move one float32 activation [rows, 768] from stage 0 to stage 1, on CPU:
- ``numpy copy``: ``np.copyto`` of the same bytes, the ceiling of this machine's memory bandwidth.
- ``in-process``: ``InProcessTransport`` send + receive, i.e. ``jax.device_put`` from stage 0's
  1-device mesh into stage 1's (another simulated CPU device), until the result is ready.
- ``cross-process``: ``TransferServerTransport`` receive in this process, pulling from a stage-0
  child process that published every step beforehand; includes the descriptor round trip.

Each cell is the median GB/s over the repeats with [min-max]; a warm-up precedes each series.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from pipejax.pp_utils import (  # noqa: E402
    InProcessTransport,
    IntermediateTensors,
    TransferServerTransport,
    stage_meshes,
)

HIDDEN = 768
SIZES = {"decode 64x768": 64, "prefill 2048x768": 2048, "large 8192x768": 8192}
WARMUP = 3

# Stage 0 in its own process: publishes steps [base, base + count) of a rows x 768 array for each
# size on stdin's request list, prints its address, then serves until stdin closes.
SENDER_SCRIPT = r"""
import sys
import jax, numpy as np
from pipejax.pp_utils import IntermediateTensors, TransferServerTransport
transport = TransferServerTransport()
for line in sys.argv[1:]:
    rows, base, count = map(int, line.split(":"))
    x = jax.device_put(np.full((rows, 768), rows, np.float32), jax.devices()[0])
    for step in range(base, base + count):
        transport.send(step, IntermediateTensors({"hidden_states": x}))
print(transport.address, flush=True)
sys.stdin.read()
"""


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


def bench_cross_process(repeats: int) -> dict[int, list[float]]:
    plan, base = [], 0
    for rows in SIZES.values():
        plan.append((rows, base))
        base += WARMUP + repeats
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    args = [f"{rows}:{b}:{WARMUP + repeats}" for rows, b in plan]
    sender = subprocess.Popen(
        [sys.executable, "-c", SENDER_SCRIPT, *args], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        address = sender.stdout.readline().strip()
        if not address:
            raise RuntimeError("the sender process exited before printing its address")
        receiver = TransferServerTransport()
        receiver.connect_previous(address, "stage 0 process")
        device = jax.sharding.SingleDeviceSharding(jax.devices()[1])
        out = {}
        for rows, b in plan:
            spec = IntermediateTensors({"hidden_states": np.zeros((rows, HIDDEN), np.float32)}).spec(
                {"hidden_states": device}
            )
            times = []
            for step in range(b, b + WARMUP + repeats):
                start = time.perf_counter()
                got = receiver.receive(step, spec, timeout=60)["hidden_states"]
                got.block_until_ready()
                times.append(time.perf_counter() - start)
            assert float(got[0, 0]) == rows
            out[rows] = times[WARMUP:]
        return out
    finally:
        sender.stdin.close()
        sender.wait(timeout=30)
        sender.stdout.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30, help="timed transfers per cell (default 30)")
    repeats = parser.parse_args().repeats

    cross = bench_cross_process(repeats)
    rows_out = []
    for label, rows in SIZES.items():
        nbytes = rows * HIDDEN * 4
        series = [bench_numpy(rows, repeats), bench_in_process(rows, repeats), cross[rows]]
        rows_out.append((label, nbytes, [_gbps(nbytes, s) for s in series], [np.median(s) * 1e3 for s in series]))

    print(f"jax {jax.__version__}, {os.cpu_count()} CPUs, float32, median GB/s [min-max] over {repeats} repeats")
    print()
    print("| size | bytes | numpy copy | in-process (device_put) | cross-process (transfer server) |")
    print("|---|---:|---:|---:|---:|")
    for label, nbytes, cells, _ in rows_out:
        text = [f"{m:.2f} [{lo:.2f}-{hi:.2f}]" for m, lo, hi in cells]
        print(f"| {label} | {nbytes / 1e6:.2f} MB | " + " | ".join(text) + " |")
    print()
    print("median time per transfer, ms:")
    print()
    print("| size | numpy copy | in-process | cross-process |")
    print("|---|---:|---:|---:|")
    for label, _, _, millis in rows_out:
        print(f"| {label} | " + " | ".join(f"{m:.3f}" for m in millis) + " |")


if __name__ == "__main__":
    main()
