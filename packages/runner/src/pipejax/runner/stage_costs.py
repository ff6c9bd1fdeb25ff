"""What each part of a decode step costs, modelled from the model's shape, for ``--pp-layer-partition auto``.

A decode step reads every weight of its stage once (for all its rows) and does ~2 FLOPs per weight per row, so
both its memory traffic and its arithmetic grow with the parameters a part holds: a part's modelled time is its
parameter count, and its memory those parameters' bytes. The first stage's embedding is a lookup (memory, no
time); the last stage's final norm and LM head (the tied embedding, where tied) are a full matmul. Attention's
KV reads grow with the context and are left out: at the contexts this machine serves they are small beside
the weights. This is a model, not a measurement (and says so where it is used).
"""

from __future__ import annotations

import logging

from pipejax.pp_utils import PartCosts, balanced_partition
from pipejax.runner.config import ModelConfig

log = logging.getLogger(__name__)

AUTO = "auto"  # the --pp-layer-partition value that asks for a cost-balanced split


def part_costs(model: ModelConfig) -> PartCosts:
    h, heads, kv = model.hidden_size, model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    attention = h * heads + 2 * h * kv + heads * h + (heads + 2 * kv if model.qkv_bias else 0)
    layer = attention + 3 * h * model.intermediate_size + 2 * h + (2 * model.head_dim if model.qk_norm else 0)
    table = model.vocab_size * h
    size = 2 if model.dtype == "bfloat16" else 4
    n = model.num_layers
    return PartCosts(layer_time=(float(layer),) * n, layer_bytes=(float(layer * size),) * n,
                     first_time=0.0, first_bytes=float(table * size),
                     last_time=float(table + h), last_bytes=float((table + h) * size))


def auto_partition(model: ModelConfig, pp: int) -> tuple[int, ...]:
    """The layer counts per stage that balance the modelled stage costs (``part_costs``)."""
    costs = part_costs(model)
    counts = balanced_partition(costs, pp)
    start, times = 0, []
    for rank, count in enumerate(counts):
        times.append(costs.stage_time(start, start + count, pp, rank) / 1e6)
        start += count
    log.info("pp layer partition auto: %s (modelled from the weights each stage reads per step: %s M parameters)",
             ",".join(map(str, counts)), ", ".join(f"{t:.1f}" for t in times))
    return counts
