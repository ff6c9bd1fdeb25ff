"""Cost-balanced stages: the split of a model's layers over ``pp`` stages whose slowest stage is fastest.

With batches in flight the slowest stage sets the pipeline's pace, and layer count is not cost: the first stage
also runs the embedding, the last one the final norm, the LM head and the sampler (SmolLM2-135M's tied head costs
about 8 of its 30 layers). ``balanced_partition`` takes each part's cost (step time, in any unit) and memory and
returns the layer counts per stage that minimise the slowest stage's time within every stage's memory: an exact
dynamic program over (stages, layers), O(pp x layers^2). Among splits with that slowest stage, the one whose
stages' times are the most even (least sum of squares), then the one with more layers in earlier stages.
Where the costs come from (measured or modelled) is the caller's business.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class PartCosts:
    """What one step costs per part: ``layer_time``/``layer_bytes`` per decoder layer (dense or MoE, each its
    own), ``first_*`` the embedding (stage 0), ``last_*`` the final norm, LM head and sampler (the last stage)."""

    layer_time: tuple[float, ...]
    layer_bytes: tuple[float, ...] | None = None
    first_time: float = 0.0
    first_bytes: float = 0.0
    last_time: float = 0.0
    last_bytes: float = 0.0

    def __post_init__(self):
        if not self.layer_time:
            raise ValueError("a model needs at least one decoder layer to split")
        if self.layer_bytes is not None and len(self.layer_bytes) != len(self.layer_time):
            raise ValueError(f"{len(self.layer_bytes)} layer sizes for {len(self.layer_time)} layer times: "
                             f"give one of each per layer")
        if min(self.layer_time) < 0 or min(self.first_time, self.last_time) < 0:
            raise ValueError("a step time cannot be negative")

    def stage_time(self, start: int, stop: int, pp: int, rank: int) -> float:
        return (sum(self.layer_time[start:stop]) + (self.first_time if rank == 0 else 0.0)
                + (self.last_time if rank == pp - 1 else 0.0))

    def stage_bytes(self, start: int, stop: int, pp: int, rank: int) -> float:
        layers = sum(self.layer_bytes[start:stop]) if self.layer_bytes is not None else 0.0
        return layers + (self.first_bytes if rank == 0 else 0.0) + (self.last_bytes if rank == pp - 1 else 0.0)


def balanced_partition(costs: PartCosts, pp: int, stage_bytes_limit: float | Sequence[float] | None = None,
                       ) -> tuple[int, ...]:
    """Layer counts per stage (each >= 1) minimising the slowest stage's time, every stage within
    ``stage_bytes_limit`` (one limit for all, or one per stage; None: no limit). Raises ``ValueError`` naming the
    smallest per-stage memory that would fit when no split does."""
    n = len(costs.layer_time)
    if pp < 1:
        raise ValueError(f"pp={pp} must be >= 1")
    if n < pp:
        raise ValueError(f"{n} layers cannot fill pp={pp} stages (each needs one); use pp <= {n}")
    limits = _limits(stage_bytes_limit, pp)
    best = _solve(costs, pp, lambda s, a, b: costs.stage_time(a, b, pp, s), limits)
    if best is None:
        need = _solve(costs, pp, lambda s, a, b: costs.stage_bytes(a, b, pp, s), [math.inf] * pp)
        smallest = max(costs.stage_bytes(a, b, pp, s) for s, (a, b) in enumerate(_ranges(need)))
        raise ValueError(f"no split of {n} layers over pp={pp} stages fits in {_fmt(limits)} per stage; the "
                         f"tightest split needs {smallest / 2**30:.2f} GiB on its fullest stage: give the stages "
                         f"that much memory, or use more stages")
    return best


def _solve(costs: PartCosts, pp: int, cost, limits: list[float]) -> tuple[int, ...] | None:
    """The split minimising max(cost(stage)) within ``limits`` (exact: a min-max dynamic program); among the
    splits with that bottleneck, the one with the least sum of squared stage costs, then the one with more layers
    in earlier stages (a second, additive program bounded by the bottleneck). None when no split fits."""
    bottleneck = _program(costs, pp, cost, limits, lambda prev, c: max(prev, c))
    if bottleneck is None:
        return None
    bound = bottleneck[0] * (1 + 1e-9) + 1e-12
    even = _program(costs, pp, lambda s, a, b: c * c if (c := cost(s, a, b)) <= bound else math.inf, limits,
                    lambda prev, c: prev + c)
    return even[1]


def _program(costs: PartCosts, pp: int, cost, limits: list[float], combine) -> tuple[float, tuple[int, ...]] | None:
    """min over splits of the ``combine``-fold of stage costs (ties: more layers in earlier stages), stages within
    ``limits``: best[s][j] is the best value for stages 0..s-1 holding layers 0..j-1, and its counts."""
    n = len(costs.layer_time)
    best: list[list[tuple[float, tuple[int, ...]] | None]] = [[None] * (n + 1) for _ in range(pp + 1)]
    best[0][0] = (0.0, ())
    for s in range(pp):
        for j in range(s + 1, n - (pp - s - 1) + 1):  # leave >= 1 layer for every later stage
            for i in range(s, j):
                prev = best[s][i]
                if prev is None or costs.stage_bytes(i, j, pp, s) > limits[s]:
                    continue
                c = cost(s, i, j)
                if c == math.inf:
                    continue
                cand = (combine(prev[0], c), (*prev[1], j - i))
                cur = best[s + 1][j]
                if cur is None or cand[0] < cur[0] * (1 - 1e-12) - 1e-15 or (
                        math.isclose(cand[0], cur[0], rel_tol=1e-12, abs_tol=1e-15) and cand[1] > cur[1]):
                    best[s + 1][j] = cand
    return best[pp][n]


def _ranges(counts: tuple[int, ...]) -> list[tuple[int, int]]:
    out, start = [], 0
    for c in counts:
        out.append((start, start + c))
        start += c
    return out


def _limits(limit: float | Sequence[float] | None, pp: int) -> list[float]:
    if limit is None:
        return [math.inf] * pp
    if isinstance(limit, (int, float)):
        return [float(limit)] * pp
    limits = [float(x) for x in limit]
    if len(limits) != pp:
        raise ValueError(f"{len(limits)} stage memory limits for pp={pp}: give one, or one per stage")
    return limits


def _fmt(limits: list[float]) -> str:
    gib = sorted({f"{x / 2**30:.2f} GiB" for x in limits})
    return gib[0] if len(gib) == 1 else "[" + ", ".join(f"{x / 2**30:.2f}" for x in limits) + "] GiB"
