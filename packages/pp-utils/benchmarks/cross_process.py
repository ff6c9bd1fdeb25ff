"""Cross-process activation transfer (stage 0 process -> stage 1 process) next to a raw ZMQ PUSH/PULL of
the same bytes between the same two processes.

    python packages/pp-utils/benchmarks/cross_process.py [--rounds 30] [--json PATH]   # needs pyzmq (the reference)
    python packages/pp-utils/benchmarks/cross_process.py --wire     # also each transfer's time on the wire (root)

The one cross-process measurement: ``transport_bench.py`` (next to it) takes its cross-process column from
here, and the benchmark report's ``transfer`` section runs this script and renders its JSON.

This process is stage 1 (the receiver); a child process is stage 0 (the sender). For every transfer
the receiver sends a one-line "go" over a ZMQ control socket and times until the data are usable
here; the sender, on "go", sends the float32 [rows, 768] activation in one of three ways:

- ``zmq``: a raw ZMQ PUSH of the array's bytes (zero-copy send), received by PULL (the reference);
- ``transport``: pipejax's ``TransferServerTransport.send`` of the jax array, ``receive`` into this
  process's device (what a pp stage does: descriptor pull, then data pull);
- ``raw pull``: one bare ``jax.experimental.transfer`` pull of the same array from a separate
  transfer server (no descriptor, blocking wait): what the transfer server itself costs.

Sizes: decode (64 x 768) and prefill (2048 x 768). The three alternate transfer by transfer;
latency is the median time per transfer, GB/s = bytes / that time, the ratio is per round.

``--wire`` measures the same transfers a second, independent way: the kernel's timestamps of their packets on
the loopback interface (``loopback_wire.py``, a capture process beside them), from the receiver's "go" to the
last packet carrying data. That leaves out both processes' own time after the bytes arrived (the receiver
noticing them, JAX making them an array), which the latency above includes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import loopback_wire  # next to this file

HIDDEN = 768
SIZES = {"decode 64x768": 64, "prefill 2048x768": 2048}
KINDS = ("zmq", "transport", "raw pull")
GOAL = 0.8
RAW_BASE = 1 << 40  # raw-pull uuids, far from the transport's (2 * step, 2 * step + 1)


def summary(values: Sequence[float]) -> dict[str, Any]:
    """Median, min and max of ``values`` (all of them kept, for the record): the report's summary shape."""
    v = sorted(float(x) for x in values)
    if not v:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0, "values": []}
    return {"median": statistics.median(v), "min": v[0], "max": v[-1], "n": len(v), "values": v}


def sender(sizes: list[int]) -> None:
    """Stage 0: serve "go" commands from the receiver until told to stop (arrays of ``sizes`` rows)."""
    import jax
    import numpy as np
    import zmq
    from jax.experimental import transfer

    from pipejax.pp_utils import IntermediateTensors, TransferServerTransport

    ctx = zmq.Context()
    control, data = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    control_port = control.bind_to_random_port("tcp://127.0.0.1")
    data_port = data.bind_to_random_port("tcp://127.0.0.1")
    transport = TransferServerTransport()
    raw = transfer.start_transfer_server(jax.local_devices()[0].client, "127.0.0.1:0", ["127.0.0.1:0"])
    arrays = {rows: jax.device_put(np.full((rows, HIDDEN), rows, np.float32)) for rows in sizes}
    host = {rows: np.asarray(a) for rows, a in arrays.items()}
    print(f"{control_port} {data_port} {transport.address} {raw.address()}", flush=True)
    send_s: dict[str, list[float]] = {}
    while True:
        kind, rows, step = control.recv_string().split()
        rows, step = int(rows), int(step)
        if kind == "stop":
            break
        start = time.perf_counter()
        if kind == "zmq":
            data.send(host[rows], copy=False)
        elif kind == "transport":
            transport.send(step, IntermediateTensors({"hidden_states": arrays[rows]}))
        else:
            raw.await_pull(RAW_BASE + step, [arrays[rows]])
        send_s.setdefault(f"{kind} {rows}", []).append(time.perf_counter() - start)
    data.send_json(send_s)  # how long each send call took here, for the breakdown
    control.close(linger=0)
    data.close(linger=1000)


def measure(rounds: int, sizes: dict[str, int] = SIZES, wire: bool = False) -> dict[str, Any]:
    """The three kinds alternated, ``rounds`` timed transfers each per size, in this process (the receiver, on its
    first local device) and a sender child on one CPU device; ``wire``: also their packets' times on ``lo``."""
    import jax
    import numpy as np
    import zmq
    from jax.experimental import transfer
    from jax.sharding import SingleDeviceSharding

    from pipejax.pp_utils import IntermediateTensors, TransferServerTransport

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
    capture, capture_path = None, None
    if wire:  # started first, so it sees every transfer's packets
        capture_path = f"/tmp/pipejax-wire-{os.getpid()}.json"
        capture = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                                 "loopback_wire.py"), capture_path],
                                   stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
        if capture.stdout.readline().strip() != "ready":
            raise RuntimeError("the loopback capture did not start (it needs root for an AF_PACKET socket)")
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--sender",
                              ",".join(str(rows) for rows in sizes.values())], env=env,
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline().split()
        if len(line) != 4:
            raise RuntimeError("the sender process exited before printing its addresses")
        control_port, data_port, address, raw_address = line
        ctx = zmq.Context()
        control, data = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        control.connect(f"tcp://127.0.0.1:{control_port}")
        data.connect(f"tcp://127.0.0.1:{data_port}")
        receiver = TransferServerTransport()
        receiver.connect_previous(address, "sender process")
        raw_server = transfer.start_transfer_server(jax.local_devices()[0].client, "127.0.0.1:0", ["127.0.0.1:0"])
        raw_conn = raw_server.connect(raw_address)
        device = SingleDeviceSharding(jax.local_devices()[0])
        steps = iter(range(10**9))
        specs = {rows: IntermediateTensors({"hidden_states": np.zeros((rows, HIDDEN), np.float32)}).spec(
            {"hidden_states": device}) for rows in sizes.values()}
        receive_s: list[float] = []  # the whole receive call
        windows: list[tuple[str, str, int, int]] = []  # (size label, kind, realtime ns before "go", after usable)

        def once(kind: str, rows: int) -> float:
            step = next(steps)
            nbytes = rows * HIDDEN * 4
            start_ns = time.time_ns()
            start = time.perf_counter()
            control.send_string(f"{kind.replace(' ', '_')} {rows} {step}")
            if kind == "zmq":
                frame = data.recv(copy=False)
                got = np.frombuffer(frame.buffer, np.float32)
                assert got.nbytes == nbytes
            elif kind == "transport":
                t0 = time.perf_counter()
                got = receiver.receive(step, specs[rows], timeout=60)["hidden_states"]
                got.block_until_ready()
                receive_s.append(time.perf_counter() - t0)
            else:
                struct = jax.ShapeDtypeStruct((rows, HIDDEN), np.float32, sharding=device)
                got = raw_conn.pull(RAW_BASE + step, [struct])[0]
                got.block_until_ready()
            elapsed = time.perf_counter() - start
            windows.append((label_of[rows], kind, start_ns, time.time_ns()))
            assert float(np.asarray(got).reshape(-1)[0]) == rows
            return elapsed

        label_of = {rows: label for label, rows in sizes.items()}

        out = {}
        for label, rows in sizes.items():
            times: dict[str, list[float]] = {k: [] for k in KINDS}
            for _ in range(3):  # warm-up
                for kind in KINDS:
                    once(kind, rows)
            phases: dict[str, list[float]] = {"descriptor wait": [], "data wait": [], "rest of receive": []}
            for r in range(rounds):
                for kind in KINDS[r % 3:] + KINDS[: r % 3]:
                    times[kind].append(once(kind, rows))
                    if kind == "transport":  # the transport's two waits per receive: descriptor, then data
                        descriptor_wait, data_wait = receiver.last_receive_waits
                        phases["descriptor wait"].append(descriptor_wait)
                        phases["data wait"].append(data_wait)
                        phases["rest of receive"].append(receive_s[-1] - descriptor_wait - data_wait)
            nbytes = rows * HIDDEN * 4
            out[label] = {
                "bytes": nbytes,
                "latency_ms": {k: summary([t * 1e3 for t in v]) for k, v in times.items()},
                "gbps": {k: summary([nbytes / t / 1e9 for t in v]) for k, v in times.items()},
                "ratio": summary([z / t for z, t in zip(times["zmq"], times["transport"], strict=True)]),
                "ratio_raw_pull": summary([z / t for z, t in zip(times["zmq"], times["raw pull"], strict=True)]),
                "transport_phases_ms": {k: summary([t * 1e3 for t in v])["median"] for k, v in phases.items()},
            }
        control.send_string("stop 0 0")
        sends = data.recv_json()
        for label, rows in sizes.items():
            out[label]["send_call_ms"] = {k: summary([t * 1e3 for t in sends.get(f"{k.replace(' ', '_')} {rows}", [])])[
                "median"] for k in KINDS}
        child.wait(timeout=30)
        if capture is not None:
            capture.terminate()
            capture.wait(timeout=30)
            with open(capture_path) as f:
                packets = json.load(f)
            for label in sizes:
                per_kind = {k: [loopback_wire.wire_ms(packets, a, b, int(control_port))
                                for lab, k2, a, b in windows if lab == label and k2 == k] for k in KINDS}
                timed = {k: [ms for ms in v[-rounds:] if ms is not None] for k, v in per_kind.items()}
                out[label]["wire_ms"] = {k: summary(v) for k, v in timed.items()}
                out[label]["wire_missing"] = {k: sum(ms is None for ms in v[-rounds:]) for k, v in per_kind.items()}
        return {"sizes": out, "rounds": rounds}
    finally:
        if child.poll() is None:
            child.kill()
        child.stdout.close()
        if capture is not None:
            if capture.poll() is None:
                capture.kill()
            capture.stdout.close()
            if os.path.exists(capture_path):
                os.unlink(capture_path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30, help="timed transfers per kind and size (default 30)")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    parser.add_argument("--wire", action="store_true", help="also time each transfer's packets on lo (root)")
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    result = measure(args.rounds, wire=args.wire)
    print(f"median GB/s [min-max] (latency ms) over {result['rounds']} rounds; ratio = ZMQ time / transport time")
    print()
    print("| size | " + " | ".join(KINDS) + " | transport / zmq |")
    print("|---|" + "---:|" * (len(KINDS) + 1))
    for label, s in result["sizes"].items():
        cells = [f"{s['gbps'][k]['median']:.2f} [{s['gbps'][k]['min']:.2f}-{s['gbps'][k]['max']:.2f}] "
                 f"({s['latency_ms'][k]['median']:.3f})" for k in KINDS]
        print(f"| {label} | " + " | ".join(cells) + f" | {s['ratio']['median']:.2f} |")
    if args.wire:
        print()
        print("On the wire (kernel timestamps on lo, the receiver's 'go' to the last data packet): median ms [min-max]")
        print("| size | " + " | ".join(KINDS) + " | zmq / raw pull | zmq / transport |")
        print("|---|" + "---:|" * (len(KINDS) + 2))
        for label, s in result["sizes"].items():
            w = s["wire_ms"]
            cells = [f"{w[k]['median']:.3f} [{w[k]['min']:.3f}-{w[k]['max']:.3f}] (n={w[k]['n']})" for k in KINDS]
            print(f"| {label} | " + " | ".join(cells) + f" | {w['zmq']['median'] / w['raw pull']['median']:.2f} | "
                  f"{w['zmq']['median'] / w['transport']['median']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--sender"]:
        sender([int(rows) for rows in sys.argv[2].split(",")])
    else:
        main()
