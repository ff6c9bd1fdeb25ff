"""The decode findings' longer prose: what the floor's matmul rate is measured against, what the prefill share is
made of, and the decode attention kernel beside XLA's formulation."""

from __future__ import annotations

from .text import fmt

DECODE_64_GOAL = 1.5  # the batch-64 decode step over its floor, at most
_LIBRARIES = {"jax": "XLA's", "torch": "torch's", "numpy": "numpy's (OpenBLAS)", "kernel": "pipejax's CPU kernel's"}


def other_libraries_lines(dd: dict, x: dict) -> list[str]:
    """The 64-row matmuls measured other ways (torch, and numpy where the run has it, each in its own process, the
    same rounds), each as a share of the 2048³ rate timed in its round, and what the best share leaves of the
    batch-64 goal: the floor assumes the 2048³ rate, so at a share s the matmuls alone take 1/s of their part of the
    floor, whatever the machine's phase. Then XLA's at twice the rows: what a pass over the weights costs apart
    from its rows."""
    t, shares = dd.get("torch_dense_matmuls_ms"), dd.get("matmul_share_64")
    if not t or not shares or "matmul_params" not in dd:
        return []
    floor, goal = x["floor_ms"]["median"], DECODE_64_GOAL
    matmul_floor_ms = 2 * 64 * dd["matmul_params"] / (dd["matmul_gflops"]["median"] * 1e9) * 1e3
    kv_ms = dd["kv_bytes_needed"] / (dd["memory_gbps"]["median"] * 1e9) * 1e3
    libs = [lib for lib in _LIBRARIES if lib in shares]
    best = max(shares[lib]["median"] for lib in libs)
    least = matmul_floor_ms / best + kv_ms
    others = [f"in torch take {fmt(t, 0)} ms"]
    if dd.get("numpy_dense_matmuls_ms"):
        others.append(f"in numpy (OpenBLAS) {fmt(dd['numpy_dense_matmuls_ms'], 0)} ms")
    named = [f"{_LIBRARIES[lib]} at {fmt(shares[lib], 2)}" for lib in libs]
    below = all(shares[lib]["median"] < 1 for lib in libs)
    line = (f"Measured {'a second way' if len(others) == 1 else 'other ways'}: the same matmuls "
            f"{' and '.join(others)}, each in a process of its own and in the same rounds. As shares of the 2048³ "
            f"rate timed in the same round, XLA's 64-row matmuls ran at {fmt(shares['jax'], 2)}, "
            f"{' and '.join(named[1:])}"
            + (f": a 64-row matmul runs below a square one's rate in {'both' if len(libs) == 2 else 'every one'} of "
               "them" if below else "") + ". At the best share the matmuls alone take "
            f"{least - kv_ms:.0f} ms of a {floor:.0f} ms floor, and with the K/V read once at the measured "
            f"bandwidth {least / floor:.2f}× it, before attention's arithmetic, the small operations and sampling")
    if least / floor > goal:
        line += f": ≤ {goal}× is out of reach on this machine for an engine built on these matmuls."
    else:
        line += f"; ≤ {goal}× leaves {goal * floor - least:.0f} ms for them."
    lines = [line]
    fixed, double = dd.get("dense_matmuls_fixed_ms"), dd.get("dense_matmuls_2x_ms")
    if fixed and double:
        single = dd["dense_matmuls_ms"]
        per_row_ms = (double["median"] - single) / 64
        read_ms = dd["weight_bytes"] / (dd["memory_gbps"]["median"] * 1e9) * 1e3
        lines.append(
            f"Why: XLA's same matmuls at 128 rows take {fmt(double, 0)} ms against {single:.0f} at 64. Each row "
            f"adds {per_row_ms:.2f} ms ({2 * dd['matmul_params'] / per_row_ms / 1e6:.0f} GFLOP/s), and "
            f"{fmt(fixed, 0)} ms (2 t(64) − t(128), per round) is paid once per pass over the weights whatever its "
            f"rows: {fixed['median'] / read_ms:.1f}× the {read_ms:.0f} ms that reading the weights once at the "
            "measured bandwidth takes. So the weights' stream from memory is not hidden behind the arithmetic, "
            "where the floor's max(compute, memory) assumes it is.")
    return lines



def prefill_lines(dd: dict, pf: dict) -> list[str]:
    """What the prefill step's share of the 2048³ rate is made of, repeat by repeat (decode section)."""
    if pf.get("repeats"):  # each repeat's step with the probes right before and after it
        reps = pf["repeats"]
        lines = [f"The step's useful work is {pf['gflops']:.0f} GFLOP. Repeat by repeat it took "
                 + ", ".join(f"{r['step_ms']:.0f} ms (probes {r['gflops_before']:.0f}/{r['gflops_after']:.0f} "
                             f"GFLOP/s: {r['share']:.2f})" for r in reps)
                 + ". A share is only as good as the rate probed beside it, and this host's speed swings between "
                 "phases of seconds (see the decode section's probes)."]
    else:  # results from before the probes beside the prefill (sorted values: not paired by repeat)
        lines = [f"The step's useful work is {pf['gflops']:.0f} GFLOP; it took {fmt(pf['step_ms'], 0)} ms against "
                 f"2048³ rates of {fmt(dd['matmul_gflops'], 0)} GFLOP/s. A share is only as good as the rate probed "
                 "beside it, and this host's speed swings between phases of seconds (see the decode section's probes)."]
    ab = (dd.get("dense_kernel_vs_xla") or {}).get("prefill")
    if ab:
        lines.append(f"The step is its dense matmuls and its attention. Its forward took {fmt(ab['kernel_ms'], 0)} "
                     f"ms with the matmuls on the CPU dense kernel against {fmt(ab['xla_ms'], 0)} ms on XLA's dot, "
                     "alternated: at the repeats' median rate that is "
                     f"{pf['gflops'] / (ab['kernel_ms']['median'] / 1e3) / dd['matmul_gflops']['median']:.2f}× and "
                     f"{pf['gflops'] / (ab['xla_ms']['median'] / 1e3) / dd['matmul_gflops']['median']:.2f}×.")
    return lines


def attention_kernel_line(dd: dict) -> str:
    """The decode attention's kernel next to XLA's formulation, same step, same batch (decode section)."""
    xla = dd["xla_attention_parts_ms"]
    p = dd["parts_ms"]
    return (f"Decode rows attend with the hand-written CPU kernel (`pipejax.runner.cpu.decode_attention`, an XLA "
            f"FFI custom call that walks each row's block table and reads every K/V slot once): the jitted forward "
            f"takes {p['forward']:.0f} ms with it against {xla['forward']:.0f} ms with XLA's formulation (a "
            "multiply-reduce over the block-table gather), same step, measured after it. ")
