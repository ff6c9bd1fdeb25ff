"""Kernel timestamps of the TCP packets on the loopback interface: what a transfer costs on the wire, apart
from the processes' own time before they send and after the bytes arrived.

    python packages/pp-utils/benchmarks/loopback_wire.py OUT.json   # until SIGTERM (needs root: AF_PACKET)

``cross_process.py --wire`` runs this next to its transfers and splits the packets by each transfer's window:
from the receiver's "go" on the control socket to the last packet carrying data (>= 1 KiB of payload). Each
packet's time is the kernel's (SO_TIMESTAMPNS, the realtime clock) when it crossed ``lo``, so a capture that
falls behind does not shift it.
"""

from __future__ import annotations

import json
import signal
import socket
import struct
import sys

ETH_P_ALL = 0x0003
SO_TIMESTAMPNS = 35
PACKET_OUTGOING = 4  # on lo every packet is seen leaving and arriving: keep the arrival
ETH_HEADER = 14


def capture(path: str) -> None:
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    sock.bind(("lo", 0))
    sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 20)
    packets: list[tuple[int, int, int, int]] = []  # (ns, source port, destination port, payload bytes)
    stop = False

    def on_term(*_):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    sock.settimeout(0.2)
    print("ready", flush=True)
    while not stop:
        try:
            data, ancillary, _, address = sock.recvmsg(128, socket.CMSG_SPACE(16))
        except TimeoutError:
            continue
        except InterruptedError:
            continue
        if address[2] == PACKET_OUTGOING or len(data) < ETH_HEADER + 20:
            continue
        ip = data[ETH_HEADER:]
        if ip[0] >> 4 != 4 or ip[9] != socket.IPPROTO_TCP:
            continue
        ihl = (ip[0] & 0x0F) * 4
        total = struct.unpack("!H", ip[2:4])[0]
        tcp = ip[ihl:]
        source, destination = struct.unpack("!HH", tcp[:4])
        payload = total - ihl - (tcp[12] >> 4) * 4
        ns = next((_timespec(d) for level, kind, d in ancillary
                   if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS), None)
        if ns is not None:
            packets.append((ns, source, destination, payload))
    with open(path, "w") as f:
        json.dump(packets, f)


def _timespec(raw: bytes) -> int:
    seconds, nanoseconds = struct.unpack("qq", raw[:16])
    return seconds * 1_000_000_000 + nanoseconds


def wire_ms(packets: list, start_ns: int, end_ns: int, control_port: int, data_bytes: int = 1024) -> float | None:
    """One transfer's time on the wire: its "go" packet (to ``control_port``) to the last packet within
    ``[start_ns, end_ns]`` that carries at least ``data_bytes`` of payload; None if either is missing."""
    window = [p for p in packets if start_ns <= p[0] <= end_ns]
    go = next((p[0] for p in window if p[2] == control_port and p[3] > 0), None)
    last = max((p[0] for p in window if p[3] >= data_bytes), default=None)
    if go is None or last is None or last < go:
        return None
    return (last - go) / 1e6


if __name__ == "__main__":
    capture(sys.argv[1])
