"""The throughput-vs-concurrency PNG next to the report (matplotlib: the benchmarks package's dependency)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .text import key


def plot(data: dict[str, Any], path: Path) -> bool:
    t = data.get("throughput")
    if not t:
        return False
    try:
        import matplotlib
    except ImportError:  # the benchmarks package's dependencies bring it
        print("[bench report] matplotlib is not installed: no plot (pip install ./benchmarks)")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    levels = t["levels"]
    for series, label, marker in (("pipejax_tps", "pipejax (pp1 tp1)", "o"), ("hf_tps", "transformers generate", "s")):
        med = [key(t[series], c)["median"] for c in levels]
        lo = [m - key(t[series], c)["min"] for m, c in zip(med, levels, strict=True)]
        hi = [key(t[series], c)["max"] - m for m, c in zip(med, levels, strict=True)]
        ax.errorbar(levels, med, yerr=[lo, hi], marker=marker, capsize=4, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens/s")
    w = t["workload"]
    ax.set_title(f"Throughput vs concurrency ({w['input_len']} in × {w['output_len']} out, 124M fp32, CPU)\n"
                 "median over repeats, bars: min–max", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True

