"""The report's formatting: a summary as 'median [min–max]', a goal's verdict, Markdown tables."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def fmt(s: dict[str, Any] | None, digits: int = 1, unit: str = "") -> str:
    """'median [min–max]' of a summary (just the median when there was one run)."""
    if not s or s.get("n", 0) == 0:
        return "—"
    m, lo, hi = s["median"], s["min"], s["max"]
    if s["n"] == 1:
        return f"{m:.{digits}f}{unit} (n=1)"
    return f"{m:.{digits}f}{unit} [{lo:.{digits}f}–{hi:.{digits}f}]"


def verdict(ratio: dict[str, Any], goal: float, higher_is_better: bool) -> str:
    m, lo, hi = ratio["median"], ratio["min"], ratio["max"]
    met = m >= goal if higher_is_better else m <= goal
    straddles = (lo < goal <= hi) if higher_is_better else (lo <= goal < hi)
    word = "**met**" if met else "**NOT met**"
    return word + (" (range straddles the goal)" if straddles and ratio["n"] > 1 else "")


def probe_agrees(decode: dict[str, Any]) -> bool:
    """The floors use the JAX bandwidth probe only if it agrees with numpy's reduction over the same resident
    bytes within 20% (median)."""
    r = decode.get("memory_vs_numpy")
    return r is not None and 0.8 <= r["median"] <= 1.2


def md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out


def key(d: dict, k) -> Any:
    """JSON turned int keys into strings."""
    return d[str(k)] if str(k) in d else d[k]



def by_batch(per_batch: dict, line: Callable[[Any], str]) -> str:
    """``line(figures)`` for each batch of ``per_batch`` (keys: batch sizes; other keys are skipped), in order."""
    batches = sorted((n for n in per_batch if str(n).isdigit()), key=int)
    return "; ".join(f"batch {n}: {line(per_batch[n])}" for n in batches)



def loads(v) -> str:
    return "/".join(f"{x:.1f}" for x in v) if v else "?"

