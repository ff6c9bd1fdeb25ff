"""The cost-balanced partition equals a brute-force optimum: uneven costs, memory limits, pp up to 8, MoE layers."""

import itertools
import random

import pytest

from pipejax.pp_utils import PartCosts, balanced_partition


def compositions(n: int, k: int):
    """Every split of n layers into k stages of >= 1."""
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        yield tuple(b - a for a, b in itertools.pairwise(bounds))


def ranges(counts):
    start = 0
    for c in counts:
        yield start, start + c
        start += c


def brute_force(costs: PartCosts, pp: int, limit: float | None):
    """The least bottleneck over every split that fits (None: none fits)."""
    best = None
    for counts in compositions(len(costs.layer_time), pp):
        spans = list(ranges(counts))
        if limit is not None and any(costs.stage_bytes(a, b, pp, s) > limit for s, (a, b) in enumerate(spans)):
            continue
        bottleneck = max(costs.stage_time(a, b, pp, s) for s, (a, b) in enumerate(spans))
        best = bottleneck if best is None else min(best, bottleneck)
    return best


def bottleneck(costs: PartCosts, counts) -> float:
    pp = len(counts)
    return max(costs.stage_time(a, b, pp, s) for s, (a, b) in enumerate(ranges(counts)))


def random_costs(rng: random.Random, n: int, moe: bool) -> PartCosts:
    times, sizes = [], []
    for i in range(n):
        expert = moe and i % 2 == 1  # every other layer an MoE layer: more bytes, a little more time
        times.append(rng.uniform(0.5, 2.0) * (1.4 if expert else 1.0))
        sizes.append(rng.uniform(1.0, 3.0) * (6.0 if expert else 1.0))
    return PartCosts(tuple(times), tuple(sizes), first_time=rng.uniform(0, 1), first_bytes=rng.uniform(0, 4),
                     last_time=rng.uniform(0, 8), last_bytes=rng.uniform(0, 10))


@pytest.mark.parametrize("seed", range(60))
def test_equals_the_brute_force_optimum(seed):
    rng = random.Random(seed)
    n, pp, moe = rng.randint(1, 12), rng.randint(1, 8), seed % 3 == 0
    pp = min(pp, n)
    costs = random_costs(rng, n, moe)
    # a memory limit that binds some of the time: between the tightest split's need and a loose one
    limit = None if seed % 4 == 0 else sum(costs.layer_bytes) / pp * rng.uniform(0.9, 2.5) + 10
    want = brute_force(costs, pp, limit)
    if want is None:
        with pytest.raises(ValueError, match="fits in .* per stage; the tightest split needs .* GiB"):
            balanced_partition(costs, pp, limit)
        return
    counts = balanced_partition(costs, pp, limit)
    assert len(counts) == pp and min(counts) >= 1 and sum(counts) == n
    assert bottleneck(costs, counts) == pytest.approx(want, rel=1e-9)
    if limit is not None:
        assert all(costs.stage_bytes(a, b, pp, s) <= limit for s, (a, b) in enumerate(ranges(counts)))


def test_a_heavy_lm_head_moves_layers_to_the_first_stage():
    """SmolLM2-135M: 30 layers of 3.54M parameters, a tied head of 28.3M on the last stage (decode reads every
    weight once: time ~ bytes). The even split (15, 15) leaves the last stage 23 units of work against 15; the
    balanced split evens them out."""
    layer, head = 3.54, 28.3
    costs = PartCosts((layer,) * 30, first_time=0.0, last_time=head)
    counts = balanced_partition(costs, 2)
    assert counts == (19, 11)
    assert bottleneck(costs, counts) < bottleneck(costs, (15, 15)) / 1.18


def test_ties_go_to_the_most_even_stages_then_to_earlier_layers():
    assert balanced_partition(PartCosts((1.0,) * 8), 4) == (2, 2, 2, 2)
    assert balanced_partition(PartCosts((1.0,) * 5), 2) == (3, 2)  # bottleneck 3 either way: earlier stage fuller


def test_per_stage_memory_limits_and_the_error_names_what_would_fit():
    costs = PartCosts((1.0,) * 6, layer_bytes=(2**30,) * 6)
    assert balanced_partition(costs, 2, [4 * 2**30, 2 * 2**30]) == (4, 2)  # time 4 vs 3+3, but stage 1 holds 2
    with pytest.raises(ValueError, match=r"fits in 2.00 GiB per stage; the tightest split needs 3.00 GiB"):
        balanced_partition(costs, 2, 2 * 2**30)
    with pytest.raises(ValueError, match="one per stage"):
        balanced_partition(costs, 2, [1, 2, 3])


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="at least one decoder layer"):
        PartCosts(())
    with pytest.raises(ValueError, match="3 layers cannot fill pp=4"):
        balanced_partition(PartCosts((1.0,) * 3), 4)
    with pytest.raises(ValueError, match="2 layer sizes for 3 layer times"):
        PartCosts((1.0,) * 3, layer_bytes=(1.0, 1.0))
