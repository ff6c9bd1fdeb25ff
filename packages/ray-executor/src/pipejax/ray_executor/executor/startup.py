"""Where an engine's start-up went, from its stages' own records: the one line ``pipejax generate`` prints."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from pipejax.worker.compile_stats import CompileStats


@dataclasses.dataclass(frozen=True)
class StartupReport:
    """``phases``: each set-up phase's wall time across the stages (first start to last end: stages run their
    phases side by side); ``compiles``: the programs each stage process built."""

    phases: dict[str, float]
    compiles: tuple[CompileStats, ...]

    @classmethod
    def from_stages(cls, timings: Sequence[Mapping[str, tuple[float, float]]], compiles: Sequence[CompileStats],
                    processes: Sequence[tuple[str, int]]) -> StartupReport:
        """Per stage by pp rank: its set-up ``timings``, its ``compiles`` (counted by its process, since the stage
        was created) and its process (host, pid). Stages sharing a process count that process's programs once."""
        phases = {}
        for name in ("init", "kernels", "load", "warmup"):
            spans = [t[name] for t in timings if name in t]
            if spans:
                phases[name] = max(end for _, end in spans) - min(start for start, _ in spans)
        per_process: dict[tuple[str, int], CompileStats] = {}
        for where, stats in zip(processes, compiles, strict=True):  # the first stage created there saw the most
            if where not in per_process or stats.programs > per_process[where].programs:
                per_process[where] = stats
        return cls(phases, tuple(per_process.values()))

    def describe(self, total_s: float | None = None) -> str:
        total = sum(self.compiles, CompileStats())
        slowest = max((c.seconds for c in self.compiles), default=0.0)
        names = {"init": "stage init", "kernels": "CPU kernel choice", "load": "weights", "warmup": "warm-up"}
        parts = [f"{names[k]} {v:.1f}s" for k, v in self.phases.items()]
        parts.append(f"{total.programs} XLA programs ({total.compiled} compiled, {total.cache_hits} from the "
                     f"compilation cache; {slowest:.1f}s in the busiest of {len(self.compiles)} processes)")
        head = f"start-up {total_s:.1f}s" if total_s is not None else "start-up"
        return f"{head}: " + ", ".join(parts)
