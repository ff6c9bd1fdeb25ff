"""Stage layer math: the even/remainder rule, explicit partitions, and their error messages."""

import itertools

import pytest

from pipejax.pp_utils import (
    PARTITION_ENV,
    parse_partition,
    partition_from_env,
    stage_layer_counts,
    stage_layer_range,
)

# ---- even split and the remainder rule -------------------------------------------------------


@pytest.mark.parametrize(
    ("num_layers", "pp_size", "expected"),
    [
        (8, 1, (8,)),
        (8, 2, (4, 4)),
        (12, 4, (3, 3, 3, 3)),
        (8, 8, (1,) * 8),
        # remainder r goes one each to stages pp-2, pp-3, ...; the last stage is spared
        (10, 4, (2, 3, 3, 2)),
        (9, 4, (2, 2, 3, 2)),
        (11, 4, (3, 3, 3, 2)),  # r = pp-1: every stage but the last gets one, stage 0 included
        (5, 2, (3, 2)),
        (16, 3, (5, 6, 5)),
        (17, 3, (6, 6, 5)),
        (15, 8, (2, 2, 2, 2, 2, 2, 2, 1)),
    ],
)
def test_even_rule_and_remainder(num_layers, pp_size, expected):
    assert stage_layer_counts(num_layers, pp_size) == expected


def test_remainder_never_lands_on_last_stage():
    for pp_size in range(2, 9):
        for num_layers in range(pp_size, 4 * pp_size + 1):
            counts = stage_layer_counts(num_layers, pp_size)
            assert counts[-1] == num_layers // pp_size, (num_layers, pp_size, counts)
            assert max(counts) - min(counts) <= 1, (num_layers, pp_size, counts)


def test_stage_layer_range_10_layers_4_stages():
    ranges = [stage_layer_range(10, rank, 4) for rank in range(4)]
    assert ranges == [range(2), range(2, 5), range(5, 8), range(8, 10)]


@pytest.mark.parametrize("pp_size", range(1, 9))
@pytest.mark.parametrize("num_layers", [8, 9, 10, 13, 24, 31, 32, 61])
def test_ranges_tile_all_layers_exactly(num_layers, pp_size):
    ranges = [stage_layer_range(num_layers, rank, pp_size) for rank in range(pp_size)]
    assert ranges[0].start == 0
    assert ranges[-1].stop == num_layers
    for left, right in itertools.pairwise(ranges):
        assert left.stop == right.start
    assert all(len(r) >= 1 for r in ranges)
    assert [i for r in ranges for i in r] == list(range(num_layers))


@pytest.mark.parametrize(
    ("pp_size", "partition"), [(4, "1,2,3,4"), (4, (4, 3, 2, 1)), (4, [1, 1, 1, 7]), (5, "2,2,2,2,2")]
)
def test_explicit_partitions_tile_all_layers_exactly(pp_size, partition):
    counts = stage_layer_counts(10, pp_size, partition)
    ranges = [stage_layer_range(10, rank, pp_size, partition) for rank in range(pp_size)]
    assert [len(r) for r in ranges] == list(counts)
    assert [i for r in ranges for i in r] == list(range(10))


# ---- explicit partitions: argument, environment, precedence ------------------------------------


@pytest.mark.parametrize("partition", ["5,6,5", " 5, 6 ,5 ", (5, 6, 5), [5, 6, 5]])
def test_explicit_partition_argument(partition):
    assert stage_layer_counts(16, 3, partition) == (5, 6, 5)
    assert stage_layer_range(16, 1, 3, partition) == range(5, 11)


def test_explicit_partition_from_env():
    partition = partition_from_env({PARTITION_ENV: "1,3,4"})
    assert stage_layer_counts(8, 3, partition) == (1, 3, 4)
    assert stage_layer_range(8, 2, 3, partition) == range(4, 8)


def test_empty_env_falls_back_to_even_rule():
    assert partition_from_env({PARTITION_ENV: ""}) is None and partition_from_env({}) is None
    assert stage_layer_counts(10, 4, partition_from_env({PARTITION_ENV: ""})) == (2, 3, 3, 2)


def test_the_environment_is_read_only_at_the_edge(monkeypatch):
    monkeypatch.setenv(PARTITION_ENV, "1,3,4")
    assert stage_layer_counts(8, 3) == (3, 3, 2)  # the even rule: pp-utils reads no environment


def test_bad_env_is_reported_like_a_bad_argument():
    with pytest.raises(ValueError, match=r"has 2 entries but pp_size=3"):
        stage_layer_counts(8, 3, partition_from_env({PARTITION_ENV: "4,4"}))


def test_parse_partition():
    assert parse_partition("5,6,5") == (5, 6, 5)
    assert parse_partition("7") == (7,)
    assert parse_partition(None) is None
    assert parse_partition("") is None
    assert parse_partition("   ") is None


# ---- errors name the offending values and the fix ----------------------------------------------


def test_wrong_sum():
    with pytest.raises(ValueError) as err:
        stage_layer_counts(16, 3, "5,5,5")
    msg = str(err.value)
    assert "(5, 5, 5)" in msg
    assert "sums to 15" in msg
    assert "num_layers=16" in msg
    assert "add up to 16" in msg


def test_wrong_count():
    with pytest.raises(ValueError) as err:
        stage_layer_counts(16, 3, (8, 8))
    msg = str(err.value)
    assert "(8, 8)" in msg
    assert "2 entries" in msg
    assert "pp_size=3" in msg
    assert "one layer count per stage" in msg


@pytest.mark.parametrize(
    ("partition", "shown"), [("8,0,8", "(8, 0, 8)"), ((8, 0, 8), "(8, 0, 8)"), ("9,-1,8", "(9, -1, 8)")]
)
def test_empty_stage(partition, shown):
    with pytest.raises(ValueError) as err:
        stage_layer_counts(16, 3, partition)
    msg = str(err.value)
    assert shown in msg
    assert "no layers" in msg
    assert ">= 1 layer" in msg


def test_fewer_layers_than_stages():
    with pytest.raises(ValueError) as err:
        stage_layer_counts(3, 4)
    msg = str(err.value)
    assert "num_layers=3" in msg
    assert "pp_size=4" in msg
    assert "pp_size <= 3" in msg


@pytest.mark.parametrize("pp_size", [0, -2])
def test_pp_size_must_be_positive(pp_size):
    with pytest.raises(ValueError, match=rf"pp_size={pp_size} must be >= 1"):
        stage_layer_counts(8, pp_size)


@pytest.mark.parametrize("pp_rank", [-1, 4, 5])
def test_rank_out_of_range(pp_rank):
    with pytest.raises(ValueError) as err:
        stage_layer_range(10, pp_rank, 4)
    msg = str(err.value)
    assert f"pp_rank={pp_rank}" in msg
    assert "pp_size=4" in msg
    assert "use 0..3" in msg


@pytest.mark.parametrize("text", ["5,six,5", "5;6;5", "5,6,", "5.5,5.5,5", "[5, 6, 5]"])
def test_non_integer_text(text):
    with pytest.raises(ValueError) as err:
        stage_layer_counts(16, 3, text)
    msg = str(err.value)
    assert repr(text) in msg
    assert "comma-separated list of integers" in msg
    assert "'5,6,5'" in msg  # the example of what to write


def test_non_integer_env():
    with pytest.raises(ValueError, match=r"'all' is not a comma-separated list of integers"):
        stage_layer_counts(16, 3, partition_from_env({PARTITION_ENV: "all"}))
