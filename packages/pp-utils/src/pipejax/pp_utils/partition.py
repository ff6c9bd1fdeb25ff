"""Which decoder layers each pipeline stage owns.

Even split rule: every stage gets ``num_layers // pp_size`` layers; the ``r`` remaining layers
go one each to the ``r`` stages just before the last one (stage ``pp_size - 2``, then
``pp_size - 3``, ...; ``r < pp_size`` so it never wraps). The last stage is spared because it
also runs the final norm, the LM head and the sampler; the first stage's embedding lookup is cheap.

An explicit partition ("5,6,5", one count per stage) overrides the rule; it comes from the
caller's config. ``PIPEJAX_PP_LAYER_PARTITION`` is read at the edge (the CLI and ``LLM``'s argument
mapping, through ``partition_from_env``), never here.
"""

from __future__ import annotations

from collections.abc import Mapping

PARTITION_ENV = "PIPEJAX_PP_LAYER_PARTITION"


def partition_from_env(environ: Mapping[str, str]) -> str | None:
    """The partition ``PIPEJAX_PP_LAYER_PARTITION`` in ``environ`` names (None when unset or empty)."""
    return environ.get(PARTITION_ENV) or None


def parse_partition(text: str | None) -> tuple[int, ...] | None:
    """'5,6,5' -> (5, 6, 5); None or '' -> None."""
    if text is None or not str(text).strip():
        return None
    try:
        return tuple(int(part) for part in str(text).split(","))
    except ValueError:
        raise ValueError(
            f"pp layer partition {text!r} is not a comma-separated list of integers; "
            f"write one layer count per stage, e.g. '5,6,5', or 'auto' for a split balanced by cost"
        ) from None


def stage_layer_counts(
    num_layers: int, pp_size: int, partition: str | tuple[int, ...] | list[int] | None = None
) -> tuple[int, ...]:
    """Layer count of every stage. ``partition=None``: the even rule."""
    if pp_size < 1:
        raise ValueError(f"pp_size={pp_size} must be >= 1")
    if num_layers < pp_size:
        raise ValueError(
            f"num_layers={num_layers} is fewer than pp_size={pp_size} stages; "
            f"use pp_size <= {num_layers}"
        )
    counts = parse_partition(partition) if isinstance(partition, str) else partition
    if counts is None:
        base, remainder = divmod(num_layers, pp_size)
        out = [base] * pp_size
        for i in range(remainder):
            out[pp_size - 2 - i] += 1
        return tuple(out)
    counts = tuple(int(c) for c in counts)
    if len(counts) != pp_size:
        raise ValueError(
            f"pp layer partition {counts} has {len(counts)} entries but pp_size={pp_size}; "
            f"give exactly one layer count per stage"
        )
    if any(c <= 0 for c in counts):
        raise ValueError(
            f"pp layer partition {counts} leaves a stage with no layers; every stage needs >= 1 layer"
        )
    if sum(counts) != num_layers:
        raise ValueError(
            f"pp layer partition {counts} sums to {sum(counts)} but the model has num_layers={num_layers}; "
            f"make the counts add up to {num_layers}"
        )
    return counts


def stage_layer_range(
    num_layers: int,
    pp_rank: int,
    pp_size: int,
    partition: str | tuple[int, ...] | list[int] | None = None,
) -> range:
    """The global indices of the decoder layers stage ``pp_rank`` owns."""
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank={pp_rank} is out of range for pp_size={pp_size}; use 0..{pp_size - 1}")
    counts = stage_layer_counts(num_layers, pp_size, partition)
    start = sum(counts[:pp_rank])
    return range(start, start + counts[pp_rank])
