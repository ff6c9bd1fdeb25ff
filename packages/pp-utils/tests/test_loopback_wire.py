"""The loopback capture behind ``cross_process.py --wire`` (the transfer bound's second measurement): a
transfer's window on synthetic packets, and a real ZMQ exchange timed by the kernel's packet stamps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import loopback_wire  # noqa: E402


def test_a_transfer_runs_from_its_go_to_its_last_data_packet():
    go_port = 7000
    packets = [
        (50, 5000, go_port, 9),  # an earlier transfer's go: outside the window
        (100, 5000, go_port, 9),  # this one's go
        (150, 7000, 5000, 0),  # an ack
        (200, 6000, 5002, 65000),
        (260, 6000, 5002, 30000),  # the last data packet
        (300, 5002, 6000, 0),
        (310, 5000, go_port, 200),  # small: not data
    ]
    assert loopback_wire.wire_ms(packets, 90, 400, go_port) == pytest.approx((260 - 100) / 1e6)
    assert loopback_wire.wire_ms(packets, 90, 400, 1234) is None  # no go seen
    assert loopback_wire.wire_ms(packets, 90, 140, go_port) is None  # no data in the window


@pytest.mark.skipif(os.geteuid() != 0, reason="an AF_PACKET capture needs root")
def test_capture_times_a_real_exchange(tmp_path):
    zmq = pytest.importorskip("zmq")
    out = tmp_path / "packets.json"
    capture = subprocess.Popen([sys.executable, str(BENCHMARKS / "loopback_wire.py"), str(out)],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert capture.stdout.readline().strip() == "ready"
        ctx = zmq.Context()
        go_in, go_out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        data_in, data_out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        go_port = go_in.bind_to_random_port("tcp://127.0.0.1")
        data_port = data_in.bind_to_random_port("tcp://127.0.0.1")
        go_out.connect(f"tcp://127.0.0.1:{go_port}")
        data_out.connect(f"tcp://127.0.0.1:{data_port}")
        payload = b"x" * (64 * 768 * 4)

        def sender():
            go_in.recv()
            time.sleep(0.02)  # the sender's own delay is on the wire too: after the go, before the data
            data_out.send(payload)

        windows = []
        for _ in range(3):
            thread = threading.Thread(target=sender)
            thread.start()
            start = time.time_ns()
            go_out.send(b"go")
            assert len(data_in.recv()) == len(payload)
            windows.append((start, time.time_ns()))
            thread.join()
        for s in (go_in, go_out, data_in, data_out):
            s.close(linger=0)
        capture.terminate()
        capture.wait(timeout=30)
        packets = json.loads(out.read_text())
        for start, end in windows:
            wire = loopback_wire.wire_ms(packets, start, end, go_port)
            assert wire is not None and 20 <= wire <= (end - start) / 1e6, (wire, (end - start) / 1e6)
    finally:
        if capture.poll() is None:
            capture.kill()
