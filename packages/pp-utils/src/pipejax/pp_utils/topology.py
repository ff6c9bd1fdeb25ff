"""Ranks for workers spread over hosts, as pure functions (no Ray here).

Ray hands back actors in creation order, which interleaves hosts. Ranks are reassigned so
that they are contiguous per host: the driver's node first, then nodes holding fewer workers,
then by IP (numerically), then by node id. Within a node, creation order is kept.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections import Counter
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class WorkerRecord:
    """What a worker reports about where it runs."""

    node_id: str
    ip: str
    creation_index: int


@dataclasses.dataclass(frozen=True)
class RankedWorker:
    rank: int
    record: WorkerRecord
    local_rank: int
    local_world_size: int
    node_rank: int


def _ip_key(ip: str) -> tuple[int, int | str]:
    try:
        addr = ipaddress.ip_address(ip)
        return (addr.version, int(addr))
    except ValueError:
        return (99, ip)


def rank_workers(
    records: Sequence[WorkerRecord], driver_ip: str | None, driver_node_id: str | None = None
) -> list[RankedWorker]:
    """Order ``records`` into final ranks; the returned list is indexed by rank.

    The driver's node is ``driver_node_id`` when given (several simulated nodes may share one
    IP), else every node whose IP is ``driver_ip``.
    """
    if len({r.creation_index for r in records}) != len(records):
        raise ValueError(f"worker records have duplicate creation indices: {list(records)}")
    per_node = Counter(r.node_id for r in records)
    if driver_node_id is not None:
        driver_nodes = {driver_node_id}
    else:
        driver_nodes = {r.node_id for r in records if driver_ip is not None and r.ip == driver_ip}

    def node_key(node_id: str):
        ip = next(r.ip for r in records if r.node_id == node_id)
        return (node_id not in driver_nodes, per_node[node_id], _ip_key(ip), node_id)

    nodes = sorted(per_node, key=node_key)
    ranked: list[RankedWorker] = []
    for node_rank, node_id in enumerate(nodes):
        local = sorted((r for r in records if r.node_id == node_id), key=lambda r: r.creation_index)
        for local_rank, record in enumerate(local):
            ranked.append(RankedWorker(len(ranked), record, local_rank, len(local), node_rank))
    return ranked


def rank_to_pp_tp(rank: int, tp_size: int) -> tuple[int, int]:
    """Global rank -> (pp_rank, tp_rank): ranks of one stage are consecutive."""
    if tp_size < 1 or rank < 0:
        raise ValueError(f"rank={rank} and tp_size={tp_size} must be >= 0 and >= 1")
    return divmod(rank, tp_size)
