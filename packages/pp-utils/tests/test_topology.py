"""Re-ranking workers so ranks are contiguous per host, driver's host first."""

import random

import pytest

from pipejax.pp_utils import RankedWorker, WorkerRecord, rank_to_pp_tp, rank_workers

HOST_A = ("node-a", "10.0.0.2")
HOST_B = ("node-b", "10.0.0.1")


def _records(*hosts: tuple[str, str]) -> list[WorkerRecord]:
    """One worker per entry, in creation order."""
    return [WorkerRecord(node_id, ip, i) for i, (node_id, ip) in enumerate(hosts)]


def _nodes_by_rank(ranked: list[RankedWorker]) -> list[str]:
    return [w.record.node_id for w in ranked]


def _assert_consistent(ranked: list[RankedWorker], records: list[WorkerRecord]):
    assert [w.rank for w in ranked] == list(range(len(records)))
    assert sorted(w.record.creation_index for w in ranked) == sorted(r.creation_index for r in records)
    node_ranks = {}
    for w in ranked:
        node_ranks.setdefault(w.record.node_id, w.node_rank)
        assert node_ranks[w.record.node_id] == w.node_rank
    # Ranks of one node are contiguous, and node ranks count up from 0 in rank order.
    assert [w.node_rank for w in ranked] == sorted(w.node_rank for w in ranked)
    assert sorted(set(node_ranks.values())) == list(range(len(node_ranks)))


# ---- the known failure: interleaved creation order --------------------------------------------


@pytest.mark.parametrize("driver", [HOST_A, HOST_B])
def test_interleaved_8_workers_on_2_hosts_become_contiguous(driver):
    other = HOST_B if driver == HOST_A else HOST_A
    records = _records(*[HOST_A, HOST_B] * 4)  # Ray's creation order: A, B, A, B, ...
    ranked = rank_workers(records, driver_ip=driver[1])
    _assert_consistent(ranked, records)
    assert _nodes_by_rank(ranked) == [driver[0]] * 4 + [other[0]] * 4
    assert [w.node_rank for w in ranked] == [0] * 4 + [1] * 4
    assert [w.local_rank for w in ranked] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert all(w.local_world_size == 4 for w in ranked)
    # Within a host, creation order is kept.
    first = 0 if driver == HOST_A else 1
    assert [w.record.creation_index for w in ranked[:4]] == [first, first + 2, first + 4, first + 6]
    assert [w.record.creation_index for w in ranked[4:]] == [1 - first, 3 - first, 5 - first, 7 - first]
    # ...so the stages of pp=2, tp=4 each sit on one host.
    stage_nodes = {}
    for w in ranked:
        pp_rank, _ = rank_to_pp_tp(w.rank, 4)
        stage_nodes.setdefault(pp_rank, set()).add(w.record.node_id)
    assert stage_nodes == {0: {driver[0]}, 1: {other[0]}}


def test_input_order_does_not_matter():
    records = _records(*[HOST_A, HOST_B] * 4)
    expected = rank_workers(records, driver_ip=HOST_A[1])
    shuffled = list(records)
    random.Random(0).shuffle(shuffled)
    assert rank_workers(shuffled, driver_ip=HOST_A[1]) == expected


# ---- node ordering: driver, fewer workers, IP, node id -----------------------------------------


def test_driver_node_first_even_with_more_workers():
    small = ("node-small", "10.0.0.1")
    driver = ("node-driver", "10.0.0.5")
    records = _records(small, driver, driver, driver)
    ranked = rank_workers(records, driver_ip=driver[1])
    _assert_consistent(ranked, records)
    assert _nodes_by_rank(ranked) == ["node-driver"] * 3 + ["node-small"]
    assert [(w.local_rank, w.local_world_size) for w in ranked] == [(0, 3), (1, 3), (2, 3), (0, 1)]


def test_fewer_workers_before_more():
    big = ("node-big", "10.0.0.1")  # lower IP, but more workers
    small = ("node-small", "10.0.0.9")
    records = _records(big, small, big, big)
    ranked = rank_workers(records, driver_ip=None)
    assert _nodes_by_rank(ranked) == ["node-small", "node-big", "node-big", "node-big"]


def test_fewer_workers_first_among_non_driver_nodes():
    driver = ("node-d", "10.0.0.100")
    three = ("node-3", "10.0.0.1")
    one = ("node-1", "10.0.0.2")
    records = _records(three, one, three, driver, three)
    ranked = rank_workers(records, driver_ip=driver[1])
    assert _nodes_by_rank(ranked) == ["node-d", "node-1", "node-3", "node-3", "node-3"]
    assert [w.node_rank for w in ranked] == [0, 1, 2, 2, 2]


def test_ip_ordering_is_numeric_not_lexicographic():
    records = _records(("n10", "10.0.0.10"), ("n9", "10.0.0.9"), ("n100", "10.0.0.100"), ("n2", "9.255.0.1"))
    ranked = rank_workers(records, driver_ip=None)
    # As strings "10.0.0.10" < "10.0.0.100" < "10.0.0.9" < "9.255.0.1"; numerically it is:
    assert _nodes_by_rank(ranked) == ["n2", "n9", "n10", "n100"]


def test_ipv4_before_ipv6_before_unparseable():
    records = _records(("host-name", "worker-7.local"), ("v6", "fd00::1"), ("v4", "192.168.1.1"))
    ranked = rank_workers(records, driver_ip=None)
    assert _nodes_by_rank(ranked) == ["v4", "v6", "host-name"]


def test_node_id_breaks_ties():
    # Two nodes behind the same IP (e.g. containers on one host) with equal worker counts.
    records = _records(("node-b", "10.0.0.1"), ("node-a", "10.0.0.1"), ("node-b", "10.0.0.1"), ("node-a", "10.0.0.1"))
    ranked = rank_workers(records, driver_ip=None)
    assert _nodes_by_rank(ranked) == ["node-a", "node-a", "node-b", "node-b"]
    assert [w.record.creation_index for w in ranked] == [1, 3, 0, 2]


def test_driver_ip_matching_no_worker_is_ignored():
    records = _records(HOST_A, HOST_B)
    ranked = rank_workers(records, driver_ip="192.168.0.1")
    assert _nodes_by_rank(ranked) == ["node-b", "node-a"]  # by IP: 10.0.0.1 < 10.0.0.2


def test_local_rank_and_world_size_on_uneven_hosts():
    a, b, c = ("a", "10.0.0.1"), ("b", "10.0.0.2"), ("c", "10.0.0.3")
    records = _records(c, a, b, c, a, c, a, a)  # a: 4 workers, b: 1, c: 3
    ranked = rank_workers(records, driver_ip="10.0.0.1")
    _assert_consistent(ranked, records)
    assert [(w.record.node_id, w.local_rank, w.local_world_size, w.node_rank) for w in ranked] == [
        ("a", 0, 4, 0),
        ("a", 1, 4, 0),
        ("a", 2, 4, 0),
        ("a", 3, 4, 0),
        ("b", 0, 1, 1),
        ("c", 0, 3, 2),
        ("c", 1, 3, 2),
        ("c", 2, 3, 2),
    ]
    assert [w.record.creation_index for w in ranked] == [1, 4, 6, 7, 2, 0, 3, 5]


def test_single_worker():
    (only,) = rank_workers(_records(HOST_A), driver_ip=HOST_A[1])
    assert only == RankedWorker(0, WorkerRecord("node-a", "10.0.0.2", 0), 0, 1, 0)


def test_no_workers():
    assert rank_workers([], driver_ip="10.0.0.1") == []


def test_duplicate_creation_indices():
    records = [WorkerRecord("a", "10.0.0.1", 0), WorkerRecord("b", "10.0.0.2", 0)]
    with pytest.raises(ValueError, match="duplicate creation indices"):
        rank_workers(records, driver_ip=None)


# ---- rank -> (pp_rank, tp_rank) ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("tp_size", "expected"),
    [
        (1, [(r, 0) for r in range(8)]),
        (2, [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1)]),
        (4, [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3)]),
        (8, [(0, t) for t in range(8)]),
    ],
)
def test_rank_to_pp_tp(tp_size, expected):
    assert [rank_to_pp_tp(r, tp_size) for r in range(8)] == expected


@pytest.mark.parametrize(("rank", "tp_size"), [(-1, 2), (0, 0), (3, -1)])
def test_rank_to_pp_tp_rejects_bad_values(rank, tp_size):
    with pytest.raises(ValueError, match=rf"rank={rank} and tp_size={tp_size}"):
        rank_to_pp_tp(rank, tp_size)


def test_driver_node_id_wins_over_shared_ip():
    """Simulated nodes on one machine share an IP: the driver's node id decides."""
    records = [WorkerRecord(node, "10.0.0.1", i) for i, node in enumerate(["n2", "n1", "n2", "n1"])]
    ranked = rank_workers(records, "10.0.0.1", driver_node_id="n2")
    assert [r.record.node_id for r in ranked] == ["n2", "n2", "n1", "n1"]
    assert [r.local_rank for r in ranked] == [0, 1, 0, 1]
