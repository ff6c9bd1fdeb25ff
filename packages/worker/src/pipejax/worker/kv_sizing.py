"""How many KV blocks a stage holds: pure arithmetic over the ``CacheConfig``, the batching limits and
the memory a caller measured (``StageWorker.kv_cache_plan`` measures; tests give numbers).

- ``num_blocks`` given: that many.
- An accelerator (its devices report ``bytes_limit``): what ``max_num_seqs x max_model_len`` need, at most
  ``memory_fraction`` (default ``DEFAULT_MEMORY_FRACTION``) of each device's free memory.
- CPU: what ``max_num_seqs x max_model_len`` need, at most this stage's share of the host's budget:
  ``cpu_kvcache_space`` GiB (default ``DEFAULT_CPU_KVCACHE_SPACE_GIB``, never more than
  ``CPU_AVAILABLE_RAM_SHARE`` of the RAM available), shared evenly by every stage of every engine on the
  host; a ``memory_fraction`` given explicitly takes that fraction of the available RAM instead.

A cache that cannot hold one request of ``max_model_len`` is an error naming the setting to change.
"""

from __future__ import annotations

import dataclasses
import math

from pipejax.runner.config import (
    CPU_AVAILABLE_RAM_SHARE,
    CPU_KVCACHE_SPACE_ENV,
    DEFAULT_CPU_KVCACHE_SPACE_GIB,
    DEFAULT_MEMORY_FRACTION,
    CacheConfig,
)

GIB = 1 << 30
BUDGET_FLAGS = f"--cpu-kvcache-space / {CPU_KVCACHE_SPACE_ENV}"


@dataclasses.dataclass(frozen=True)
class KVCachePlan:
    """One stage's KV cache size and why (``describe`` is the line the engine prints)."""

    num_blocks: int
    block_size: int
    stage_bytes_per_block: int  # every device of the stage together (host RAM on CPU)
    source: str  # "num_blocks", "device", "cpu_fraction" or "cpu_budget"
    max_num_seqs: int
    max_model_len: int
    need_blocks: int  # max_num_seqs x max_model_len's blocks, plus the padding block
    memory_fraction: float | None = None  # "device", "cpu_fraction"
    budget_bytes: int | None = None  # "cpu_budget": the host's budget
    budget_capped_by_ram: bool = False  # the default budget, lowered to a share of the available RAM
    host_available_bytes: int | None = None
    stages_on_host: int = 1  # sharers of a CPU budget: this engine's stages on the host ...
    engines_on_host: int = 1  # ... times the engines on it

    @property
    def sharers(self) -> int:
        return self.stages_on_host * self.engines_on_host

    def describe(self) -> str:
        tokens = self.num_blocks * self.block_size
        head = (f"KV cache: {self.num_blocks:,} blocks x {self.block_size} tokens ({tokens:,} tokens), "
                f"{_size(self.num_blocks * self.stage_bytes_per_block)} per stage")
        fits = self.num_blocks >= self.need_blocks
        seqs = f"{self.max_num_seqs} sequence{'s' if self.max_num_seqs > 1 else ''}"
        need = f"what {seqs} x {self.max_model_len:,} tokens need"
        if self.source == "num_blocks":
            return f"{head}; set by --num-kv-blocks"
        if self.source == "device":
            share = f"{self.memory_fraction:g} of each device's free memory"
            return f"{head}; {need + ', within ' if fits else ''}{share} (--gpu-memory-utilization)"
        if self.source == "cpu_fraction":
            share = f"{self.memory_fraction:g} of the host's available RAM shared by {self.sharing}"
            return f"{head}; {need + ', within ' if fits else ''}{share} (--gpu-memory-utilization)"
        budget = f"CPU budget {self.budget_bytes / GIB:.3g} GiB"
        if self.budget_capped_by_ram:
            budget += f" ({CPU_AVAILABLE_RAM_SHARE:.0%} of the {self.host_available_bytes / GIB:.1f} GiB available RAM)"
        why = need if fits else "capped by the budget"
        return f"{head}, {why}; {budget} shared by {self.sharing} ({BUDGET_FLAGS})"

    @property
    def sharing(self) -> str:
        stages = f"{self.sharers} stage{'s' if self.sharers > 1 else ''} on this host"
        if self.engines_on_host > 1:
            stages += f" ({self.engines_on_host} engines x {self.stages_on_host})"
        return stages


def _size(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB // 10 else f"{nbytes / (1 << 20):.1f} MiB"


def plan_kv_cache(
    cache: CacheConfig,
    *,
    device_bytes_per_block: int,
    tp_size: int,
    max_num_seqs: int,
    max_model_len: int,
    device_free_bytes: int | None,
    host_available_bytes: int,
    stages_on_host: int = 1,
) -> KVCachePlan:
    """The plan of a stage whose KV block takes ``device_bytes_per_block`` on each of its ``tp_size``
    devices. ``device_free_bytes``: an accelerator's free memory per device (None on CPU);
    ``host_available_bytes``: the host's available RAM; ``stages_on_host``: this engine's stages on the host
    (``cache.engines_on_host`` engines of them share a CPU budget)."""
    assert stages_on_host >= 1 and tp_size >= 1 and device_bytes_per_block > 0
    blocks_per_seq = math.ceil(max_model_len / cache.block_size)
    plan = KVCachePlan(
        num_blocks=0, block_size=cache.block_size, stage_bytes_per_block=device_bytes_per_block * tp_size,
        source="", max_num_seqs=max_num_seqs, max_model_len=max_model_len,
        need_blocks=1 + max_num_seqs * blocks_per_seq, host_available_bytes=host_available_bytes,
        stages_on_host=stages_on_host, engines_on_host=cache.engines_on_host,
    )
    if cache.num_blocks is not None:
        return dataclasses.replace(plan, num_blocks=cache.num_blocks, source="num_blocks")
    if device_free_bytes is not None:
        fraction = cache.memory_fraction if cache.memory_fraction is not None else DEFAULT_MEMORY_FRACTION
        plan = dataclasses.replace(plan, source="device", memory_fraction=fraction)
        limit, per_block = int(device_free_bytes * fraction), device_bytes_per_block
    elif cache.memory_fraction is not None:
        plan = dataclasses.replace(plan, source="cpu_fraction", memory_fraction=cache.memory_fraction)
        limit, per_block = int(host_available_bytes * cache.memory_fraction) // plan.sharers, plan.stage_bytes_per_block
    else:
        budget, capped = _cpu_budget(cache, host_available_bytes)
        plan = dataclasses.replace(plan, source="cpu_budget", budget_bytes=budget, budget_capped_by_ram=capped)
        limit, per_block = budget // plan.sharers, plan.stage_bytes_per_block
    blocks = min(plan.need_blocks, limit // per_block)
    if blocks < 1 + blocks_per_seq:
        raise ValueError(_too_small(plan, limit, blocks, 1 + blocks_per_seq))
    return dataclasses.replace(plan, num_blocks=blocks)


def _cpu_budget(cache: CacheConfig, host_available_bytes: int) -> tuple[int, bool]:
    """The host's CPU KV budget in bytes, and whether the default was lowered to fit the available RAM."""
    if cache.cpu_kvcache_space is not None:
        return int(cache.cpu_kvcache_space * GIB), False
    default, safe = int(DEFAULT_CPU_KVCACHE_SPACE_GIB * GIB), int(host_available_bytes * CPU_AVAILABLE_RAM_SHARE)
    return min(default, safe), safe < default


def _too_small(plan: KVCachePlan, limit: int, blocks: int, one_request: int) -> str:
    need = _size(one_request * plan.stage_bytes_per_block)
    short = (f"gives each stage {_size(limit)} = {blocks} KV block(s) of {plan.block_size} tokens, fewer than "
             f"one request of max_model_len={plan.max_model_len} needs ({one_request} blocks, {need} per stage)")
    if plan.source == "device":
        return (f"{plan.memory_fraction:g} of a device's free memory {short}; raise --gpu-memory-utilization, "
                f"lower --max-model-len, or give --num-kv-blocks")
    if plan.source == "cpu_fraction":
        return (f"--gpu-memory-utilization {plan.memory_fraction:g} of the host's "
                f"{plan.host_available_bytes / GIB:.1f} GiB available RAM, shared by {plan.sharing}, {short}; "
                f"raise it, lower --max-model-len, or drop it for the CPU budget ({BUDGET_FLAGS})")
    assert plan.budget_bytes is not None
    budget = f"the CPU KV cache budget of {plan.budget_bytes / GIB:.3g} GiB"
    if plan.budget_capped_by_ram:
        budget += (f" (the {DEFAULT_CPU_KVCACHE_SPACE_GIB:g} GiB default lowered to {CPU_AVAILABLE_RAM_SHARE:.0%} "
                   f"of the host's {plan.host_available_bytes / GIB:.1f} GiB available RAM)")
    wanted = math.ceil(one_request * plan.stage_bytes_per_block * plan.sharers / GIB * 100) / 100
    return (f"{budget}, shared by {plan.sharing}, {short}; give {BUDGET_FLAGS} of at least {wanted:g} GiB, "
            f"lower --max-model-len, or place fewer stages on this host")


VLLM_CPU_KVCACHE_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"  # vLLM's CPU backend's own budget (GiB; 0: unset)


def gib_from_env(name: str, value: str) -> float:
    """Environment variable ``name``'s ``value`` as GiB, or an error that names it and the fix."""
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a number of GiB; set it to e.g. 4, or unset it") from None


def cpu_kvcache_space_from_env(environ) -> float | None:
    """The CPU KV budget in GiB an edge reads from ``environ`` for the vLLM host: ``PIPEJAX_CPU_KVCACHE_SPACE``,
    else vLLM's own ``VLLM_CPU_KVCACHE_SPACE`` (which vLLM reads as 0 when unset); None: the default."""
    for name, unset in ((CPU_KVCACHE_SPACE_ENV, ("",)), (VLLM_CPU_KVCACHE_SPACE_ENV, ("", "0"))):
        if environ.get(name, "") not in unset:
            return gib_from_env(name, environ[name])
    return None
