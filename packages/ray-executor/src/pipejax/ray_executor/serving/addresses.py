"""Where every ZMQ socket of a DP deployment lives, decided before anything starts.

The head computes the addresses and hands them to every engine at creation (Ray actor arguments,
process arguments), so nobody needs a handshake round to find anybody. With a base port
(``--data-parallel-rpc-port``) the layout is fixed, so a ``--headless`` node computes the same
addresses from the same flags:

    base + 0          coordinator PULL (engine stats)
    base + 1          coordinator PUB  (load updates)
    base + 2 + 2 i    API server i ROUTER (requests)
    base + 3 + 2 i    API server i PULL   (outputs)
"""

from __future__ import annotations

import dataclasses
import socket

LOOPBACK = "127.0.0.1"


@dataclasses.dataclass(frozen=True)
class DPAddresses:
    host: str  # what the head binds to and engines connect to
    stats_port: int
    publish_port: int
    input_ports: tuple[int, ...]  # one per API server
    output_ports: tuple[int, ...]

    @classmethod
    def create(cls, host: str | None, base_port: int | None, api_server_count: int) -> DPAddresses:
        host = host or LOOPBACK
        n = 2 + 2 * api_server_count
        if base_port:
            ports = list(range(base_port, base_port + n))
        else:
            ports = free_ports(host, n)
        return cls(host, ports[0], ports[1], tuple(ports[2::2]), tuple(ports[3::2]))

    @property
    def api_server_count(self) -> int:
        return len(self.input_ports)

    def _tcp(self, port: int) -> str:
        return f"tcp://{self.host}:{port}"

    @property
    def stats(self) -> str:
        return self._tcp(self.stats_port)

    @property
    def publish(self) -> str:
        return self._tcp(self.publish_port)

    def input(self, client_index: int) -> str:
        return self._tcp(self.input_ports[client_index])

    def output(self, client_index: int) -> str:
        return self._tcp(self.output_ports[client_index])


def free_ports(host: str, count: int) -> list[int]:
    """``count`` distinct ports free on ``host`` right now (the OS picks; all held until all are known)."""
    held = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            held.append(s)
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()
