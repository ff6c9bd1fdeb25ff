"""The benchmark report: run every benchmark section in its own process and write BENCHMARKS.md (and a
PNG of throughput vs concurrency) from what they measured — each figure next to its reference, measured
in the same run, medians over repeats with min–max. Nothing in the report is typed in by hand: every
number comes from the sections' JSON, and a goal that is not met says so, with what bounds it.

    python benchmarks/report.py [--quick] [--repeats N] [--output BENCHMARKS.md] [--sections a,b]
    python benchmarks/report.py --from-results DIR   # re-render a previous run's JSON
    nox -s bench_report                                                     # the same, in its own venv

Each section is a module of ``pipejax_benchmarks.sections``, run as
``python -m pipejax_benchmarks.sections.<name>`` with benchmarks/ on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# section -> (module, simulated CPU devices in the section's process, what it measures)
SECTIONS: dict[str, tuple[str, int, str]] = {
    "decode": ("decode", 1, "decode step vs the machine's floor"),
    "memory": ("memory", 1, "peak RSS of a pp=2 stage worker"),
    "transfer": ("transfer", 1, "cross-process activation transfer vs raw ZMQ"),
    "executors": ("executors", 1, "Ray / compiled-graph vs in-process step time"),
    "pipeline": ("pipeline", 2, "pp=2 with 2 batches in flight vs 1"),
    "throughput": ("throughput", 1, "output tokens/s vs transformers, and vs concurrency"),
    "coldstart": ("coldstart", 0, "cold start of pipejax generate"),
}
SECTION_TIMEOUT_S = 1800
BENCH_DIR = Path(__file__).resolve().parents[1]  # benchmarks/: holds pipejax_benchmarks/
# A "## " section of the existing report whose heading carries this mark was measured by another command
# (named in it) and is kept, unchanged, at the end of the regenerated report.
KEPT_MARK = "not part of `pipejax bench report`"


def kept_sections(previous: str) -> str:
    """The sections of a previous report whose heading says they come from another command ("" if none)."""
    kept, keep = [], False
    for line in previous.splitlines(keepends=True):
        if line.startswith("## "):
            keep = KEPT_MARK in line
        if keep:
            kept.append(line)
    return "".join(kept)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Run every benchmark section and write BENCHMARKS.md (+ a throughput plot)")
    p.add_argument("--quick", action="store_true", help="one repeat, fewer sizes (about half the time)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per figure (default 3; --quick: 1)")
    p.add_argument("--output", default="BENCHMARKS.md", help="the report (the PNG goes next to it)")
    p.add_argument("--plot", default=None, help="PNG path (default: benchmarks_throughput.png next to --output)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of: {', '.join(SECTIONS)}")
    p.add_argument("--results-dir", default=None, help="keep the sections' JSON and py-spy profiles here")
    p.add_argument("--from-results", default=None, help="render from this results folder without measuring")
    p.add_argument("--no-profile", action="store_true", help="skip the py-spy runs where a goal is not met")
    return p


# --- running the sections ------------------------------------------------------------------------


def section_env(devices: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(JAX_PLATFORMS="cpu", RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", TF_CPP_MIN_LOG_LEVEL="2",
               TOKENIZERS_PARALLELISM="false")
    env.pop("XLA_FLAGS", None)
    env["PYTHONPATH"] = os.pathsep.join([str(BENCH_DIR), *filter(None, [env.get("PYTHONPATH")])])
    if devices:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return env


def run_sections(names: list[str], results: Path, repeats: int, quick: bool, profile: bool) -> dict[str, Any]:
    meta: dict[str, Any] = {"sections": {}}
    for name in names:
        module, devices, what = SECTIONS[name]
        out = results / f"{name}.json"
        cmd = [sys.executable, "-m", f"pipejax_benchmarks.sections.{module}", "--json", str(out),
               "--repeats", str(repeats)]
        cmd += ["--quick"] if quick else []
        cmd += ["--profile-dir", str(results)] if profile else []
        print(f"[bench report] {name}: {what} ...", flush=True)
        start = time.perf_counter()
        log = results / f"{name}.log"
        with open(log, "w") as f:
            try:
                proc = subprocess.run(cmd, env=section_env(devices), stdout=f, stderr=subprocess.STDOUT,
                                      timeout=SECTION_TIMEOUT_S)
                rc = proc.returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        seconds = time.perf_counter() - start
        meta["sections"][name] = {"rc": rc, "seconds": seconds}
        if rc != 0:
            tail = log.read_text(errors="replace")[-1500:]
            meta["sections"][name]["error"] = tail
            print(f"[bench report] {name} FAILED ({rc}) after {seconds:.0f}s; see {log}", flush=True)
        else:
            print(f"[bench report] {name}: done in {seconds:.0f}s", flush=True)
    return meta


def load_results(results: Path) -> dict[str, Any]:
    data = {}
    for name in SECTIONS:
        f = results / f"{name}.json"
        if f.exists():
            data[name] = json.loads(f.read_text())
    return data


# --- formatting ----------------------------------------------------------------------------------


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


def _key(d: dict, k) -> Any:
    """JSON turned int keys into strings."""
    return d[str(k)] if str(k) in d else d[k]


# --- the report ----------------------------------------------------------------------------------


DECODE_64_GOAL = 1.5  # the batch-64 decode step over its floor, at most
_LIBRARIES = {"jax": "XLA's", "torch": "torch's", "numpy": "numpy's (OpenBLAS)", "kernel": "pipejax's CPU kernel's"}


def _other_libraries_lines(dd: dict, x: dict) -> list[str]:
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


def _by_batch(per_batch: dict, line: Callable[[Any], str]) -> str:
    """``line(figures)`` for each batch of ``per_batch`` (keys: batch sizes; other keys are skipped), in order."""
    batches = sorted((n for n in per_batch if str(n).isdigit()), key=int)
    return "; ".join(f"batch {n}: {line(per_batch[n])}" for n in batches)


def _prefill_lines(dd: dict, pf: dict) -> list[str]:
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


def _attention_kernel_line(dd: dict) -> str:
    """The decode attention's kernel next to XLA's formulation, same step, same batch (decode section)."""
    xla = dd["xla_attention_parts_ms"]
    p = dd["parts_ms"]
    return (f"Decode rows attend with the hand-written CPU kernel (`pipejax.runner.cpu.decode_attention`, an XLA "
            f"FFI custom call that walks each row's block table and reads every K/V slot once): the jitted forward "
            f"takes {p['forward']:.0f} ms with it against {xla['forward']:.0f} ms with XLA's formulation (a "
            "multiply-reduce over the block-table gather), same step, measured after it. ")

class Report:
    def __init__(self, data: dict[str, Any], meta: dict[str, Any], plot_name: str | None):
        self.d = data
        self.meta = meta
        self.plot_name = plot_name
        self.findings: list[tuple[str, list[str]]] = []  # (title, lines) for goals not met

    # one row of the summary table per figure: [figure, measured, reference, ratio, goal, verdict]
    def summary_rows(self) -> list[list[str]]:
        rows = []
        d = self.d
        if "throughput" in d:
            t = d["throughput"]
            c = t["levels"][-1]
            r = _key(t["ratio"], c)
            rows.append([f"output tokens/s, {c} req × {t['workload']['input_len']} in × {t['workload']['output_len']} "
                         "out (pp1 tp1)", fmt(_key(t["pipejax_tps"], c)),
                         f"transformers `generate` (batch {c}): {fmt(_key(t['hf_tps'], c))}",
                         fmt(r, 2, "×"), "≥ 1.6×", verdict(r, 1.6, True)])
            if t.get("greedy"):
                g = t["greedy"]
                rows.append([f"greedy: output tokens/s, {c} req (as the first row)", fmt(g["pipejax_tps"]),
                             f"transformers `generate`, greedy: {fmt(g['hf_tps'])}", fmt(g["ratio"], 2, "×"),
                             "≥ 1.6×", verdict(g["ratio"], 1.6, True)])
            low = t["levels"][0]
            if low != c:
                lr = _key(t["ratio"], low)
                rows.append([f"output tokens/s, {low} req × {t['workload']['input_len']} in × "
                             f"{t['workload']['output_len']} out", fmt(_key(t["pipejax_tps"], low)),
                             f"transformers `generate`: {fmt(_key(t['hf_tps'], low))}", fmt(lr, 2, "×"), "≥ 1.2×",
                             verdict(lr, 1.2, True)])
                if t.get("bf16"):
                    bf = t["bf16"]
                    rows.append([f"bf16: output tokens/s, {c} req (as the first row)", fmt(bf["pipejax_tps"]),
                                 f"transformers `generate` in bf16: {fmt(bf['hf_tps'])}", fmt(bf["ratio"], 2, "×"),
                                 "reported (torch's bf16 uses AMX; XLA:CPU has no AMX path)", "reported"])
                worst = min(t["levels"], key=lambda level: _key(t["ratio"], level)["median"])
                wr = _key(t["ratio"], worst)
                rows.append([f"lowest ratio over concurrency {', '.join(str(x) for x in t['levels'])} "
                             f"(at c = {worst})", fmt(_key(t["pipejax_tps"], worst)),
                             f"transformers: {fmt(_key(t['hf_tps'], worst))}", fmt(wr, 2, "×"), "≥ 1.0× at every c",
                             verdict(wr, 1.0, True)])
        if "decode" in d:
            dd = d["decode"]
            x = _key(dd["decode"], 64)
            probe_ok = probe_agrees(dd)
            rows.append(["decode step at batch 64 (ms)", fmt(x["step_ms"]),
                         f"floor = max(FLOPs/matmul rate, (weight + K/V bytes)/bandwidth): {fmt(x['floor_ms'])} "
                         f"({x['bound']}-bound)", fmt(x["ratio"], 2, "×"), f"≤ {DECODE_64_GOAL}×",
                         verdict(x["ratio"], DECODE_64_GOAL, False) if probe_ok else
                         "**no verdict**: the bandwidth probe under its floor disagrees with numpy's (next row)"])
            one = dd["decode"].get("1")
            if one:
                rows.append(["decode step at batch 1 (ms)", fmt(one["step_ms"]),
                             f"floor: {fmt(one['floor_ms'])} ({one['bound']}-bound)", fmt(one["ratio"], 2, "×"),
                             "≤ 1.3×", verdict(one["ratio"], 1.3, False) if probe_ok else
                             "**no verdict**: the bandwidth probe disagrees with numpy's"])
            pf = dd.get("prefill")
            if pf:
                rows.append([f"{pf['tokens']}-token prefill step ({pf['rows']} prompts), useful FLOP rate as a share "
                             "of JAX's 2048³ matmul rate (same repeat)",
                             f"{fmt(pf['step_ms'])} ms, {pf['gflops']:.0f} GFLOP",
                             ("the higher of two 2048³ probes, right before and right after it"
                              if pf.get("repeats") else "the matmul rate in the decode table's repeats"),
                             fmt(pf["share_of_matmul_rate"], 2, "×"),
                             "≥ 0.85×", verdict(pf["share_of_matmul_rate"], 0.85, True)])
            if "memory_vs_numpy" in dd:
                rows.append(["resident read bandwidth, JAX reduction over 1 GiB (GB/s)",
                             fmt(dd["memory_gbps"], 2), "numpy `add.reduce` over a resident 1 GiB: "
                             f"{fmt(dd.get('numpy_gbps'), 2)}", fmt(dd["memory_vs_numpy"], 2, "×"), "0.8–1.2×",
                             "**met**" if probe_ok else "**NOT met**"])
        if "pipeline" in d:
            p = d["pipeline"]
            rows.append(["pp=2 output tokens/s, 2 batches in flight (each stage on its own cores)",
                         fmt(_key(p["tps"], 2)),
                         f"same engine, 1 batch in flight: {fmt(_key(p['tps'], 1))}", fmt(p["ratio"], 2, "×"),
                         "≥ 1.6×", verdict(p["ratio"], 1.6, True)])
        if "executors" in d:
            e = d["executors"]
            rows.append(["Ray executor step (pp1 tp1, batch 32 decode, ms)", fmt(e["step_ms"]["ray"]),
                         f"in-process executor: {fmt(e['step_ms']['in-process'])}", fmt(e["ratio_ray"], 3, "×"),
                         "≤ 1.10×", verdict(e["ratio_ray"], 1.10, False)])
            rows.append(["compiled-graph step (same, ms)", fmt(e["step_ms"]["ray compiled graph"]),
                         f"plain Ray calls: {fmt(e['step_ms']['ray'])}", fmt(e["ratio_cg"], 3, "×"), "≤ 1.0×",
                         verdict(e["ratio_cg"], 1.0, False)])
        if "transfer" in d:
            for label, s in d["transfer"]["sizes"].items():
                rows.append([f"cross-process activation transfer, {label}: GB/s (latency ms)",
                             f"{fmt(s['gbps']['transport'], 2)} ({s['latency_ms']['transport']['median']:.3f} ms)",
                             f"raw ZMQ PUSH/PULL, same bytes, same processes: {fmt(s['gbps']['zmq'], 2)} "
                             f"({s['latency_ms']['zmq']['median']:.3f} ms)",
                             fmt(s["ratio"], 2, "×"), "≥ 0.8×", verdict(s["ratio"], 0.8, True)])
        if "memory" in d:
            m = d["memory"]
            w = m["probes"][m["worst_stage"]]
            full = m["full_weight_bytes"] / 2**20
            rows.append([f"peak RSS of a pp=2 stage worker while loading ({m['worst_stage']}), MiB over the "
                         f"process baseline ({w['base_mb']['median']:.0f} MiB)", fmt(w["load_growth_mb"], 0),
                         f"full model weights: {full:.0f} MiB", fmt(w["ratio"], 3, "×"), "≤ 0.6× (+ baseline)",
                         verdict(w["ratio"], 0.6, False)])
        if "coldstart" in d:
            c = d["coldstart"]
            biggest = max(c["phases"].items(), key=lambda kv: kv[1]["median"])
            rows.append(["cold start of `pipejax generate` to first token (s)", fmt(c["total"]),
                         f"largest part: {biggest[0]} {biggest[1]['median']:.1f} s (breakdown below)", "—",
                         "reported", "reported"])
            if "warm_cache_total" in c:
                rows.append(["later starts (persistent compilation cache filled by the first), s",
                             fmt(c["warm_cache_total"]), f"first start: {fmt(c['total'])}",
                             fmt(c["warm_vs_first"], 2, "×"), "reported", "reported"])
        return rows

    # --- per-section detail and findings ---------------------------------------------------------

    def throughput(self) -> list[str]:
        t = self.d["throughput"]
        out = ["## Output tokens/s vs transformers, and vs concurrency", ""]
        out += [f"Each point: c concurrent requests × {t['workload']['input_len']} prompt tokens × "
                f"{t['workload']['output_len']} output tokens (random ids, ignore_eos, temperature 1 on both sides). "
                f"pipejax: {t['engine']['layout']}, {t['engine'].get('settings', 'explicit settings')} "
                f"(max_num_seqs {t['engine'].get('max_num_seqs', '?')}, "
                f"max_num_batched_tokens {t['engine']['max_num_batched_tokens']}); "
                f"transformers: one `generate` over the c prompts, fp32, {t['hf_threads']} torch threads. "
                "Each engine runs in a fresh process of its own; the timed runs alternate between them, and the ratio "
                "is taken per repeat.", ""]
        rows = []
        for c in t["levels"]:
            rows.append([c, fmt(_key(t["pipejax_tps"], c)), fmt(_key(t["hf_tps"], c)),
                         fmt(_key(t["ratio"], c), 2, "×")])
        out += md_table(["concurrency", "pipejax output tok/s", "transformers output tok/s", "ratio"], rows)
        if t.get("greedy"):
            g, c = t["greedy"], t["levels"][-1]
            out += ["", f"The same c = {c} runs with greedy decoding on both sides (pipejax temperature 0, "
                    "transformers `do_sample=False`), alternated in the same repeats: pipejax "
                    f"{fmt(g['pipejax_tps'])} output tok/s, transformers {fmt(g['hf_tps'])}, ratio "
                    f"{fmt(g['ratio'], 2, '×')}."]
        if "shapes_compiled_during_timed_runs" in t:
            out += ["", f"Shapes compiled during the timed runs: {t['shapes_compiled_during_timed_runs']}."]
        if self.plot_name:
            out += ["", f"![output tokens/s vs concurrency]({self.plot_name})"]
        b = t.get("breakdown")
        if b:
            out += ["", f"Where the last headline run's {b['wall_s']:.1f} s went (stage step trace):", ""]
            rows = []
            for kind in ("prefill", "decode"):
                k = b[kind]
                ex = k.get("executed_flops")
                rows.append([f"{kind} steps", k["steps"], f"{k['seconds']:.1f}", k["tokens"], k["padded_tokens"],
                             f"{k['median_step_ms']:.0f}", f"{k['flops'] / 1e9:.0f}",
                             f"{ex / 1e9:.0f}" if ex else "—",
                             f"{k['attention_flops'] / 1e9:.0f} / {k['executed_attention_flops'] / 1e9:.0f}"
                             if ex else "—",
                             f"{k['gflops_per_s']:.0f}", f"{ex / k['seconds'] / 1e9:.0f}" if ex else "—"])
            rows.append(["engine around the steps", "", f"{b['engine_s']:.1f}"] + [""] * 8)
            out += md_table(["part", "steps", "seconds", "tokens", "tokens after padding", "median step ms",
                             "useful GFLOP", "executed GFLOP (padded shapes)", "attention GFLOP useful / executed",
                             "useful GFLOP/s", "executed GFLOP/s"], rows)
            out += ["", "Useful = each token through every layer, the LM head once per sampled row, attention once "
                    "per (token, position it attends to); executed = the same for the padded step shapes (tokens; "
                    "prefill rows × longest query + decode rows, each against the context slots)."]
            out += ["", f"Matmul rate measured right after that run: {b['matmul_gflops']:.1f} GFLOP/s (2048³ fp32 "
                    f"in JAX). Cores busy at c = {t['levels'][-1]} (CPU seconds / wall seconds of the benchmark "
                    f"process): pipejax {fmt(t['cores_busy']['pipejax'], 2)}, transformers "
                    f"{fmt(t['cores_busy']['transformers'], 2)} of {os.cpu_count()}."]
        c = t["levels"][-1]
        r = _key(t["ratio"], c)
        if r["median"] < 1.6 and b:
            flops = b["prefill"]["flops"] + b["decode"]["flops"]
            hf = _key(t["hf_tps"], c)
            pj = _key(t["pipejax_tps"], c)
            hf_s = c * t["workload"]["output_len"] / hf["median"]
            pj_s = c * t["workload"]["output_len"] / pj["median"]
            ideal = flops / (b["matmul_gflops"] * 1e9)
            ceiling = hf_s / ideal
            lines = [
                f"The workload is {flops / 1e12:.2f} TFLOP of useful work ({b['prefill']['tokens']} prefill and "
                f"{b['decode']['tokens']} decode tokens through the 124M-parameter model): {ideal:.1f} s at the "
                f"{b['matmul_gflops']:.0f} GFLOP/s JAX's matmul reached here, even with nothing else to do. "
                f"transformers took {hf_s:.1f} s (median), i.e. {flops / hf_s / 1e9:.0f} GFLOP/s of useful work "
                f"(torch's own 2048³ matmul ran at {b['torch_matmul_gflops']:.0f} GFLOP/s next to JAX's "
                f"{b['matmul_gflops']:.0f}). So the best any JAX engine could do against it here is about "
                f"{ceiling:.2f}×" + (
                    f" — the 1.6× goal is out of reach on this {os.cpu_count()}-core machine: an engine with no "
                    f"overhead at all would still need {ideal:.1f} s for these FLOPs, and batched `generate` on "
                    "equal-length prompts wastes no padding for an engine to win back."
                    if ceiling < 1.6 else "; the rest of the gap is pipejax's, not the machine's.")
                + f" pipejax's run took {pj_s:.1f} s: its useful work ran at {ideal / pj_s:.0%} of JAX's matmul rate "
                f"(1.6× asks {1.6 / ceiling:.0%} of it here; the issue's ≈ 75% assumed a 2.1× ceiling).",
                *self._parts_floor_lines(b, hf_s, pj_s),
                f"pipejax spent {b['prefill']['seconds']:.1f} s in {b['prefill']['steps']} prefill steps at "
                f"{b['prefill']['gflops_per_s']:.0f} GFLOP/s ({b['prefill']['gflops_per_s'] / b['matmul_gflops']:.0%} "
                "of JAX's matmul rate" + (": at the machine's limit as JAX sees it"
                                          if b["prefill"]["gflops_per_s"] >= 0.8 * b["matmul_gflops"] else "")
                + f") and {b['decode']['seconds']:.1f} s in "
                f"{b['decode']['steps']} decode steps at only {b['decode']['gflops_per_s']:.0f} GFLOP/s (see the "
                f"decode section). The engine around the steps took {b['engine_s']:.1f} s.",
                *self._padding_lines(b),
            ]
            low = t["levels"][0]
            lr = _key(t["ratio"], low)
            bl = t.get("breakdown_low")
            if lr["median"] < 1.0 and bl:
                hf_ms = 1e3 / _key(t["hf_tps"], low)["median"]
                sb = t.get("smallest_buckets", {})
                lines.append(
                    f"At concurrency {low} pipejax is slower than transformers ({lr['median']:.2f}×): its decode step "
                    f"takes {bl['decode']['median_step_ms']:.0f} ms for {low} token(s) — padded to the smallest "
                    f"buckets ({sb.get('tokens', '?')} tokens × {sb.get('rows', '?')} rows), with the LM head, "
                    f"attention and sampling over all of them — while transformers averages {hf_ms:.0f} ms per "
                    "token (its prefill included). At batch 1 the step should be bound by reading the weights "
                    "(see the decode table).")
            if hf["n"] > 1:
                lines.append(
                    f"Noise: in this run transformers' c = {c} runs ranged {hf['min']:.0f}–{hf['max']:.0f} tok/s, "
                    f"pipejax's {pj['min']:.0f}–{pj['max']:.0f}; both slow down when other processes take cores "
                    "(see the load averages and the cores busy above).")
            self.findings.append(("Output tokens/s vs transformers (goal ≥ 1.6×)", lines))
        return out

    @staticmethod
    def _parts_floor_lines(b: dict[str, Any], hf_s: float, pj_s: float) -> list[str]:
        """The same ceiling measured a second way: the run's own parts, timed alone (``throughput.parts_floor``)."""
        pf = b.get("parts_floor")
        if not pf:
            return []
        ceiling = hf_s / pf["seconds"]
        decode = max((x for x in pf["shapes"] if x[0] == x[1]), key=lambda x: x[2], default=None)  # most steps
        return [
            "The same ceiling measured a second way, from this run's parts rather than its FLOP count: "
            + ("the dense matmuls of each step's tokens as the engine runs them (the CPU dense kernel over weights "
               "in panels)" if pf.get("dots") == "cpu-kernel" else
               # runs from before the kernel ran prefill steps too kept their dots as "decode_dots"
               "the dense matmuls of each step's tokens (XLA:CPU's dot in prefill steps, the CPU dense kernel over "
               "weights in panels in decode steps)" if pf.get("decode_dots") == "cpu-kernel" else
               "XLA:CPU's own dots for each step's tokens")
            + f", timed alone over resident weights right after the run, take "
            f"{pf['dots_s']:.1f} s"
            + (f" (a {decode[0]}-row decode step's {decode[3] * 1e3:.0f} ms × {decode[2]})" if decode else "")
            + f", and the K/V the decode tokens read once takes {pf['kv_s']:.1f} s at the measured bandwidth: "
            f"{pf['seconds']:.1f} s with no attention arithmetic, sampling or engine at all, against transformers' "
            f"{hf_s:.1f} s — a ceiling of {ceiling:.2f}×. pipejax's run was {pj_s / pf['seconds']:.2f}× that floor"
            + (f"; 1.6× would need it within {ceiling / 1.6:.2f}×." if ceiling >= 1.6 else
               ": by this measure 1.6× is out of reach in this run, whatever the FLOP count allows.")]

    @staticmethod
    def _padding_lines(b: dict[str, Any]) -> list[str]:
        k = b["prefill"]
        ex, att, ex_att = k.get("executed_flops"), k["attention_flops"], k.get("executed_attention_flops")
        if not ex or ex < 1.1 * k["flops"]:
            return []
        return [f"Padding: the prefill steps ran {ex / 1e12:.2f} TFLOP for {k['flops'] / 1e12:.2f} TFLOP of useful "
                f"work ({ex / k['flops']:.2f}×); attention: {ex_att / 1e12:.2f} TFLOP executed for "
                f"{att / 1e12:.2f} needed ({(ex_att - att) / (ex - k['flops']):.0%} of the excess). Prefill rows "
                "are padded to the longest chunk of their step and every row's context to the widest block table "
                "(decode rows of a mixed step have their own one-query attention); each chunk of 16+ query slots "
                "scores only the context a right-aligned row can see from it"
                + (f"; the scores take {k['score_bytes'] / 1e9:.1f} GB of fp32 over these steps (written, then "
                   "read and rewritten by the masking and the softmax), memory traffic on top of the FLOPs"
                   if k.get("score_bytes") else "")
                + ". On executed FLOPs the prefill ran at "
                f"{ex / k['seconds'] / 1e9:.0f} GFLOP/s ({ex / k['seconds'] / 1e9 / b['matmul_gflops']:.0%} of "
                "JAX's matmul rate)."]

    def decode(self) -> list[str]:
        dd = self.d["decode"]
        out = ["## Decode step vs the machine's floor", ""]
        out += [f"Runner step (pp1 tp1, fp32, {dd['context']} tokens of context per request, sampling included). "
                f"Measured in the same repeats: matmul {fmt(dd['matmul_gflops'])} GFLOP/s (2048³ fp32"
                + ("; in each repeat the higher of a probe between its prefill and its decode steps and one after "
                   "the steps, as read: "
                   + ", ".join(f"{a:.0f}/{b:.0f}" for a, b in dd["matmul_gflops_before_after"])
                   + " — this host's speed swings between phases of seconds"
                   if dd.get("matmul_gflops_before_after") else "")
                + f"), memory "
                f"{fmt(dd['memory_gbps'], 2)} GB/s read (a JAX reduction over a resident 1 GiB array: a decode step "
                "streams its weights and K/V, so reads are its bound)"
                + (f"; numpy's reduction over a resident 1 GiB: {fmt(dd['numpy_gbps'], 2)} GB/s (JAX / numpy "
                   f"{fmt(dd['memory_vs_numpy'], 2, '×')})" if "numpy_gbps" in dd else "")
                + (f"; numpy's copy between resident 1 GiB buffers, read + write counted: "
                   f"{fmt(dd['numpy_copy_gbps'], 2)} GB/s (a copy also reads each destination line before "
                   "writing it, so it moves about what one read stream does)" if "numpy_copy_gbps" in dd else "")
                + ".", ""]
        rows = []
        for b, x in sorted(dd["decode"].items(), key=lambda kv: int(kv[0])):
            rows.append([b, fmt(x["step_ms"]), fmt(x["floor_ms"]), f"{x['compute_ms']['median']:.1f}",
                         f"{x['memory_ms']['median']:.1f}", fmt(x["ratio"], 2, "×"), x["bound"]])
        out += md_table(["batch", "step ms", "floor ms", "FLOPs/rate ms", "(weights + K/V)/bandwidth ms",
                         "step / floor",
                         "floor bound by"], rows)
        p = dd["parts_ms"]
        loop = dd.get("layer_loop_ms") or {}
        if "error" in p:
            out += ["", f"(The step's parts could not be timed: {p['error']}.)"]
            return out
        out += ["", "The step at batch 64, in parts (median ms): "
                f"host inputs {p['inputs']:.1f}, jitted forward {p['forward']:.1f}, sampling {p['sample']:.1f}; "
                f"the same model's dense matmuls alone (every weight once, batch 64, one jit; the median of the "
                f"alternated rounds below): "
                f"{dd['dense_matmuls_ms']:.1f} ms. Padded step shape (tokens, prefill rows, query, decode rows, "
                f"blocks, prefill blocks) = {p['shape']}."]
        x64 = _key(dd["decode"], 64)
        if x64["ratio"]["median"] <= DECODE_64_GOAL:  # (over the goal, the finding below carries this cross-check)
            cross = _other_libraries_lines(dd, x64)
            if cross:
                out += ["", "Cross-check of the floor's matmul rate. " + " ".join(cross)]
        if loop:
            out += ["", "The same dense matmuls read through a `lax.scan` over the layers' stacked weights (as the "
                    "runner's layer loop reads them) against a loop over per-layer arrays, alternated, median ms: "
                    + _by_batch(loop, lambda t: f"scan {fmt(t['scan_ms'])}, per-layer arrays {fmt(t['per_layer_ms'])}")
                    + ". The difference is the copy of each layer's weights that the scan's dynamic slice makes on "
                    "XLA:CPU before its dots read them."]
        ab = dd.get("unrolled_vs_scan") or {}
        if ab:
            out += ["", "So the runner's decode steps on CPU run the layers unrolled over per-layer views of the "
                    "stacked weights (`StageRunner(decode_layers=...)`, \"unrolled\" by default on CPU: each view "
                    "aliases its layer's memory, nothing is copied); prefill steps keep the scan. The runner's "
                    "decode step both ways, alternated, median ms: "
                    + _by_batch(ab, lambda t: f"unrolled {fmt(t['unrolled_ms'])}, scan {fmt(t['scan_ms'])}")
                    + ". The first step of each (its compile included): "
                    + _by_batch(ab, lambda t: f"unrolled {t['unrolled_first_s']:.1f} s, scan {t['scan_first_s']:.1f} s")
                    + "."]
        kab = dd.get("dense_kernel_vs_xla") or {}
        if kab:
            out += ["", "The runner's decode steps on CPU run their dense matmuls on a hand-written kernel "
                    "(`StageRunner(dense_matmuls=...)`, \"cpu-kernel\" by default for float32 on CPU; "
                    "`pipejax.runner.cpu.dense`, an XLA FFI custom call compiled by numba). The stage stores each "
                    "dense weight in panels of 32 output columns (`model.Panels`), so that the kernel streams a "
                    "panel from contiguous memory while its 8 × 32 output tiles stay in registers; prefill steps run "
                    "on it too. The dense matmuls alone, same rounds, median ms: "
                    + _by_batch({n: t for n, t in loop.items() if t.get("kernel_ms")},
                                lambda t: f"kernel {fmt(t['kernel_ms'])}, XLA's dot {fmt(t['per_layer_ms'])}")
                    + ". The runner's decode step both ways, alternated, median ms: "
                    + _by_batch(kab, lambda t: f"kernel {fmt(t['kernel_ms'])}, XLA's dot {fmt(t['xla_ms'])}")
                    + "." + (" A 2048-token prefill forward on the kernel took "
                             f"{fmt(kab['prefill']['kernel_ms'], 0)} ms against "
                             f"{fmt(kab['prefill']['xla_ms'], 0)} ms on XLA's dot over [in, out] weights, "
                             "alternated."
                             if "prefill" in kab else "")]
        pab = dd.get("prefill_attention_vs_xla")
        if pab:
            out += ["", "The prefill rows' attention runs on a hand-written CPU kernel too "
                    "(`StageRunner(prefill_attention=...)`, `pipejax.runner.cpu.prefill_attention`): one task per "
                    "(row, KV head) reads the row's K and V once from the paged cache and multiplies on the dense "
                    "kernel's microkernel, each tile of queries only as far into the context as it sees. The "
                    f"2048-token prefill forward took {fmt(pab['kernel_ms'], 0)} ms with it against "
                    f"{fmt(pab['xla_ms'], 0)} ms with XLA's formulation (a block-table gather, then small batched "
                    "matmuls), alternated."]
        if dd.get("few_row_dots") and dd.get("dense_matmuls", "xla") == "xla":
            lo, hi = dd["few_row_dots_rows"]
            out += ["", f"Decode steps of {lo}-{hi} rows ran their dots on **{dd['few_row_dots']}** here "
                    "(`StageRunner(few_row_dots=...)`, `pipejax.runner.cpu.dots`: at its first such step the runner "
                    "reads the choice an earlier process left next to the compilation cache, or else "
                    "times a 16-row pair of MLP dots with XLA:CPU's default YNNPACK fusions and without them, and "
                    "picks XLA's own "
                    "dot, \"eigen\", only where it is clearly faster); every other step keeps XLA's default."]
        one = _key(dd["decode"], 1) if "1" in dd["decode"] or 1 in dd["decode"] else None
        if one and one["ratio"]["median"] > 1.3 and loop:
            t = _key(loop, 1)
            scan_ms, per_layer_ms = t["scan_ms"]["median"], t["per_layer_ms"]["median"]
            self.findings.append(("Decode step at batch 1 vs floor (goal ≤ 1.3×)", [
                f"At batch 1 the step reads every weight once: its floor is the weights' and K/V bytes at the "
                f"measured bandwidth, {one['floor_ms']['median']:.1f} ms, against a {one['step_ms']['median']:.1f} "
                "ms step.",
                f"The weights' matmuls alone take {per_layer_ms:.1f} ms as a loop over per-layer arrays and "
                f"{scan_ms:.1f} ms read through a scan over stacked weights, which is how the runner's layer loop "
                f"reads them: the scan's copy of each layer's weights costs {scan_ms - per_layer_ms:.1f} ms of the "
                "step, and the matmul-vector products themselves read the weights at "
                f"{dd['weight_bytes'] / (per_layer_ms / 1e3) / 1e9:.1f} GB/s against the "
                f"{dd['memory_gbps']['median']:.1f} GB/s a reduction reads."
                + (f" On the CPU dense kernel over weights in panels, as the runner's decode steps run them, they "
                   f"take {t['kernel_ms']['median']:.1f} ms: "
                   f"{dd['weight_bytes'] / (t['kernel_ms']['median'] / 1e3) / 1e9:.1f} GB/s."
                   if dd.get("dense_matmuls") == "cpu-kernel" and t.get("kernel_ms") else ""),
            ] + ([
                f"The runner's decode steps read per-layer views of the weights (unrolled layers), which removes "
                f"that copy: the step took {_key(ab, 1)['unrolled_ms']['median']:.1f} ms that way against "
                f"{_key(ab, 1)['scan_ms']['median']:.1f} ms as a layer scan, alternated. What remains above the "
                "floor is " + ("the kernel's" if dd.get("dense_matmuls") == "cpu-kernel" else "XLA:CPU's")
                + " matrix-vector products, which read the weights below the reduction's rate."
            ] if ab and ("1" in ab or 1 in ab) else [])))
        x = _key(dd["decode"], 64)
        if x["ratio"]["median"] > DECODE_64_GOAL:
            kernel = dd.get("dense_matmuls") == "cpu-kernel" and dd.get("kernel_dense_matmuls_ms")
            dots_ms = kernel["median"] if kernel else dd["dense_matmuls_ms"]
            rest = p["forward"] - dots_ms
            mb = 2**20
            dense_rate = 2 * 64 * dd["matmul_params"] / (dots_ms / 1e3) / 1e9 if "matmul_params" in dd \
                else float("nan")
            lines = [
                f"The weights' matmuls alone take {dots_ms:.0f} ms at batch 64 on "
                + ("the CPU dense kernel, as the runner's decode steps run them" if kernel else "XLA's dot")
                + f" ({dense_rate:.0f} GFLOP/s, {dense_rate / dd['matmul_gflops']['median']:.0%} of the 2048³ rate "
                "the floor assumes): matmuls with 64 rows run below a large square one's rate, which the floor "
                f"cannot see. That gap is {dots_ms - x['floor_ms']['median']:.0f} ms of the step.",
            ] + _other_libraries_lines(dd, x) + [
                f"Of the {p['forward']:.0f} ms forward, the weights' matmuls account for about "
                f"{dots_ms:.0f} ms; the other {rest:.0f} ms is attention over the paged KV cache "
                "(with the norms, RoPE and cache writes). "
                + (_attention_kernel_line(dd) if dd.get("xla_attention_parts_ms") else
                   "Decode rows attend by a multiply-reduce over the block-table gather that XLA fuses. ")
                + f"{dd['kv_slots_gathered']} slots per row for {dd['context'] + 1} used (the padding columns all "
                f"point at block 0), {dd['kv_bytes_needed'] / mb:.0f} MiB of K/V needed per "
                f"step (and {dd['weight_bytes'] / mb:.0f} MiB of weights). At the "
                f"{dd['memory_gbps']['median']:.1f} GB/s this machine moves, reading that K/V once takes "
                f"{dd['kv_bytes_needed'] / (dd['memory_gbps']['median'] * 1e9) * 1e3:.0f} ms."
                + (f" Why the kernel: XLA:CPU's block-table gather of every layer's K and V blocks, each summed over "
                   f"its slots and nothing else (one jit), takes {dd['kv_gather_ms']:.0f} ms for "
                   f"{dd['kv_bytes_gathered'] / mb:.0f} MiB, {dd['kv_bytes_gathered'] / dd['kv_gather_ms'] / 1e6:.1f} "
                   f"GB/s against the {dd['memory_gbps']['median']:.1f} GB/s a reduction over resident memory "
                   "reads: XLA:CPU's gather, not the arithmetic, made most of XLA's attention."
                   if dd.get("kv_gather_ms") else ""),
                f"Sampling adds {p['sample']:.0f} ms ({p['sample'] / (p['inputs'] + p['forward'] + p['sample']):.0%} "
                "of the step) for 64 rows × 32000 logits at temperature 1 (scaling, then one uniform draw per row "
                "against the running sum of the weights, taken in two levels over 128-wide vocabulary blocks; "
                "min-p, top-k and top-p cost nothing when no row uses them).",
                "The floor counts the weights and the K/V bytes a decode step must read at least once "
                f"({dd['kv_bytes_needed'] / mb:.0f} MiB here, "
                f"{dd['kv_bytes_needed'] / (dd['memory_gbps']['median'] * 1e9) * 1e3:.0f} ms); it cannot see the "
                "64-row matmuls' lower rate (the gap above).",
                "Suggested: on TPU, a ragged paged-attention kernel (Pallas) in place of the XLA formulation; on "
                "CPU, the weights' matmuls at 64 rows are what remains ("
                + ("the CPU dense kernel's rate below the 2048³ one" if kernel else "XLA:CPU's own dot") + ")"
                + ("" if dd.get("unrolled_vs_scan") else ", and the copy of each layer's weights that the layer "
                   "scan's dynamic slice makes before the dots read them "
                   "(`benchmarks/probes/layer_loop_bench.py`)") + ".",
            ]
            self.findings.append(("Decode step vs floor (goal ≤ 1.5×)", lines))
        pf = dd.get("prefill")
        if pf and pf["share_of_matmul_rate"]["median"] < 0.85:
            self.findings.append(("2048-token prefill step vs JAX's matmul rate (goal ≥ 0.85×)",
                                  _prefill_lines(dd, pf)))
        return out

    def pipeline(self) -> list[str]:
        p = self.d["pipeline"]
        variants = p.get("variants") or {"shared cores": p}
        out = ["## pp=2: two batches in flight vs one", ""]
        out += [f"Two pp=2 tp=1 engines on this machine's {p['cpus']} cores, the headline workload each. "
                "**own cores** (the goal's figure): the Ray executor with `pin_stage_cpus`, each stage actor confined "
                "to its own half of the cores — as each stage owns its chips on a TPU slice. **shared cores**: the "
                "in-process executor, two stage threads whose XLA computations share all the cores. Each engine's "
                "batch queue is capped at 2 or 1 between runs (`max_batches_in_flight`), so both settings share "
                "compiled code and alternate under the same load. Cores busy = the engine's processes' CPU seconds "
                "/ wall seconds during the run; machine busy = the share of all cores busy with anything, from "
                "/proc/stat.", ""]
        rows = []
        for name, v in variants.items():
            for depth in (2, 1):
                rows.append([name, depth, fmt(_key(v["tps"], depth)), fmt(_key(v["cores_busy"], depth), 2),
                             fmt({k: x * 100 if isinstance(x, float) else x
                                  for k, x in _key(v["machine_busy"], depth).items()}, 0, "%"),
                             fmt(v["ratio"], 2, "×") if depth == 2 else ""])
        out += md_table(["engine", "batches in flight", "output tok/s", f"cores busy (of {p['cpus']})",
                         "machine busy", "2 vs 1"], rows)
        shapes = {n: v["shapes_compiled_during_timed_runs"] for n, v in variants.items()
                  if "shapes_compiled_during_timed_runs" in v}
        if shapes:
            out += ["", "Shapes compiled during the timed runs: " + ", ".join(f"{n}: {c}" for n, c in shapes.items())
                    + " (0: no compile inside the timed runs)."]
        shared = variants.get("shared cores")
        if shared and shared["ratio"]["median"] < 1.6:
            c2, c1 = _key(shared["cores_busy"], 2)["median"], _key(shared["cores_busy"], 1)["median"]
            out += ["", f"With shared cores the second batch in flight adds {shared['ratio']['median']:.2f}×: with one "
                    f"batch in flight the engine already kept {c1:.2f} of the {p['cpus']} cores busy (XLA spreads "
                    f"each stage's work over all of them), with two {c2:.2f}; the second batch can only fill the "
                    "gaps the host-side work of a step leaves. That is a bound of the machine, not of the schedule."]
        if p["ratio"]["median"] < 1.6:
            c2, c1 = _key(p["cores_busy"], 2)["median"], _key(p["cores_busy"], 1)["median"]
            lines = [
                f"With each stage on its own cores, 2 batches in flight gave {p['ratio']['median']:.2f}× the "
                f"throughput of 1 (goal ≥ 1.6×). One batch in flight kept {c1:.2f} cores busy (one stage at a "
                f"time, as expected), two kept {c2:.2f} of {p['cpus']}: the stages still idle part of the time. "
                "Two things are on the stages' cores or their critical path: the driver (engine, scheduling, "
                "detokenizing, Ray calls) and Ray's own processes run on the same 2 cores, and each batch's "
                "turnaround (last stage → driver → first stage) comes before the next step of the same requests "
                "can start. Not profiled further here; on a TPU host the driver and Ray have cores of their own.",
                "The py-spy lines (shared-cores engine) show where the host-side time goes.",
            ]
            self.findings.append(("pp=2 throughput, 2 in flight vs 1 (goal ≥ 1.6×)",
                                  lines + self.profile_lines("pipeline")))
        return out

    def executors(self) -> list[str]:
        e = self.d["executors"]
        w = e["workload"]
        cg, beside = "ray compiled graph", "ray beside an idle compiled graph"
        out = ["## Executors: Ray and Ray Compiled Graph vs in-process", ""]
        out += [f"pp1 tp1, {w['batch']} requests × {w['input_len']} in × {w['output_len']} out; a step is one "
                f"`LLMEngine.step()` whose batch is {w['batch']} decode rows; per run its median, then median "
                "[min–max] over runs. Phase 1 alternates in-process and Ray; phase 2 adds the compiled-graph engine "
                "and alternates it with Ray (whose runs are then beside an idle graph, reported apart; the "
                "compiled graph is compared with phase 1's Ray runs). The stage's own time comes from its step "
                "trace (not reachable inside a compiled graph); cores = a process's CPU seconds / wall seconds "
                "during the runs.", ""]
        rows = []
        for mode, st in e["step_ms"].items():
            own = e["stage_ms"].get(mode)
            cores = e.get("cores", {}).get(mode, {})
            actor = None if mode == "in-process" else cores.get("ray actor" if mode == beside else f"{mode} actor")
            idle_cg = cores.get(f"{cg} actor") if mode != cg else None
            rows.append([mode, fmt(st), fmt(own) if own else "—",
                         f"{st['median'] - own['median']:.1f}" if own else "—",
                         fmt(cores.get("driver"), 2), fmt(actor, 2) if actor else "—",
                         fmt(idle_cg, 2) if idle_cg else "—"])
        out += md_table(["engine", "engine step ms", "stage's own step ms", "added by executor + engine, ms",
                         "driver cores", "its stage actor cores", "idle compiled-graph actor cores"], rows)
        out += ["", f"Ray start for this section: {e['ray_start_s']:.1f} s. (In-process, the driver runs the stage "
                "itself, so its cores are the XLA work.)"]
        ratio = e["ratio_ray"]
        if ratio["median"] > 1.10:
            extra = e["step_ms"]["ray"]["median"] - e["step_ms"]["in-process"]["median"]
            own = [e["stage_ms"].get(k, {}).get("median") for k in ("ray", "in-process")]
            lines = [f"The Ray step is {fmt(ratio, 3, '×')} the in-process one (goal ≤ 1.10×): {extra:.1f} ms more "
                     "per step" + (f", of which the stage's own step accounts for {own[0] - own[1]:.1f} ms (the "
                                   "same code, slower in the actor)" if all(own) else "") + "."]
            self.findings.append(("Ray executor step vs in-process (goal ≤ 1.10×)",
                                  lines + self.profile_lines("executors", prefix="ray:")))
        ratio = e["ratio_cg"]
        if ratio["median"] > 1.0:
            extra = e["step_ms"][cg]["median"] - e["step_ms"]["ray"]["median"]
            cores = e.get("cores", {})
            drv = cores.get(cg, {}).get("driver", {}).get("median")
            lines = [f"The compiled-graph step is {fmt(ratio, 3, '×')} the plain Ray one (goal ≤ 1.0×): {extra:.1f} "
                     "ms more per step."]
            if drv is not None and drv > 0.3:
                lines.append(
                    f"While it runs, the driver process is busy {drv:.2f} cores although it only waits for the "
                    f"graph's output (plain Ray: {cores.get('ray', {}).get('driver', {}).get('median', 0):.2f}): "
                    f"Ray's compiled-graph channel read polls. On this {os.cpu_count()}-core machine that CPU comes "
                    "out of the stage's XLA computation.")
            idle = cores.get(beside, {}).get(f"{cg} actor", {}).get("median")
            if idle is not None and idle > 0.2 and beside in e["step_ms"]:
                lines.append(
                    f"And while idle, the graph's stage actor polls its input channel: {idle:.2f} cores while plain "
                    f"Ray ran beside it, whose step went from {e['step_ms']['ray']['median']:.0f} ms (phase 1) to "
                    f"{e['step_ms'][beside]['median']:.0f} ms.")
            probe = e.get("cg_wait_probe")
            if probe:
                values = list(probe.values())
                lines.append(
                    "Measured in the same run: a compiled graph whose actor only sleeps 200 ms per step keeps the "
                    "driver busy while it waits — " + "; ".join(f"{k}: {v:.2f} cores" for k, v in probe.items())
                    + (". The setting pipejax's `CompiledPipeline` uses (the whole step timeout as "
                       "`read_iteration_timeout`) makes it worse: leave it at Ray's default."
                       if values[0] > 1.5 * values[-1] else
                       ". The read polls whatever `read_iteration_timeout` is."))
            lines.append(
                "Suggested: on hosts with few cores, keep plain actor calls (the default); where the compiled graph "
                "is used, give every spinning reader a core of its own (the driver's reader thread, and each stage "
                "actor's loop) — TPU hosts have them to spare — and never leave an idle compiled graph running "
                "beside other work. With pp = 1 there is no control hop to save, so the graph cannot win here; "
                "its case is pp ≥ 2 on several hosts.")
            self.findings.append(("Compiled-graph step vs plain Ray (goal ≤ 1.0×)",
                                  lines + self.profile_lines("executors", prefix=f"{cg}:")))
        return out

    def transfer(self) -> list[str]:
        t = self.d["transfer"]
        out = ["## Cross-process activation transfer vs raw ZMQ", ""]
        out += [f"Stage 0 in a child process, stage 1 here; per transfer a one-line \"go\" over ZMQ, then the "
                f"activation; timed until usable in the receiver. {t['rounds']} rounds per size, the three ways "
                "alternating. `raw pull` is one bare `jax.experimental.transfer` pull of the same array (no "
                "descriptor, blocking wait): what the transfer server itself costs.", ""]
        rows = []
        for label, s in t["sizes"].items():
            for kind in ("zmq", "transport", "raw pull"):
                rows.append([label, kind, fmt(s["latency_ms"][kind], 3), fmt(s["gbps"][kind], 2),
                             f"{s['send_call_ms'][kind]:.3f}"])
        out += md_table(["size", "way", "latency ms", "GB/s", "sender's send call ms"], rows)
        bad = [(label, s) for label, s in t["sizes"].items() if s["ratio"]["median"] < 0.8]
        if bad:
            lines = []
            for label, s in bad:
                lat = s["latency_ms"]
                ph = s["transport_phases_ms"]
                lines.append(
                    f"{label}: the transport takes {lat['transport']['median']:.2f} ms against ZMQ's "
                    f"{lat['zmq']['median']:.2f} ms; a bare transfer-server pull of the same bytes takes "
                    f"{lat['raw pull']['median']:.2f} ms ({s['ratio_raw_pull']['median']:.2f}× ZMQ's GB/s). Inside "
                    f"`receive`: {ph['descriptor wait']:.2f} ms waiting for the descriptor and, issued with it "
                    "(the receiver keeps a pull plan per spec once the first step has shown the sender's layout), "
                    f"the data; {ph['data wait']:.2f} ms more for data still arriving; "
                    f"{ph.get('rest of receive', float('nan')):.2f} ms of Python around them (plan check, "
                    f"issuing the pulls). The sender's `send` call takes {s['send_call_ms']['transport']:.2f} ms.")
            raw_bad = [label for label, s in t["sizes"].items() if s["ratio_raw_pull"]["median"] < 0.8]
            lines.append(
                "So the bound is the transfer server's own path (one bulk connection; more gave no speed-up for "
                "a single-device array"
                + (f"; a bare pull alone is already below the goal at {', '.join(raw_bad)}" if raw_bad else "")
                + "), plus, at the decode size, the descriptor that still travels with every step and the wait "
                "loop. Carrying the spec in the step's control message (the driver already sends the batch to "
                "every stage) would drop the descriptor pull; beating ZMQ's loopback copy would need the server's "
                "transfer path itself to be faster. On TPU slices the transfer server moves device memory over "
                "the data-center network (DCN), where ZMQ's host copy is not an alternative.")
            self.findings.append(("Cross-process activation transfer (goal ≥ 0.8× ZMQ's GB/s)", lines))
        return out

    def memory(self) -> list[str]:
        m = self.d["memory"]
        out = ["## Peak RSS of a stage worker", ""]
        out += [f"Fresh process per probe; baseline = peak RSS after importing JAX and pipejax and starting the "
                f"CPU backend; then `StageWorker.load` (weights + {m['kv_blocks']}-block KV cache); then one prefill "
                f"and one decode step (two compiles). Full checkpoint: {m['full_weight_bytes'] / 2**20:.0f} MiB.", ""]
        rows = []
        for name, p in m["probes"].items():
            rows.append([name, f"{p['base_mb']['median']:.0f}", fmt(p["load_growth_mb"], 0),
                         f"{p['param_mb']:.0f}", f"{p['kv_mb']:.0f}", f"{p['largest_param_mb']:.0f}",
                         fmt(p["served_growth_mb"], 0), fmt(p["ratio"], 3, "×")])
        out += md_table(["probe", "baseline MiB", "growth at load MiB", "its weights MiB", "KV MiB",
                         "largest tensor MiB", "growth after 2 steps MiB", "load growth / full weights"], rows)
        w = m["probes"][m["worst_stage"]]
        if w["ratio"]["median"] > 0.6:
            extra = w["load_growth_mb"]["median"] - w["param_mb"] - w["kv_mb"]
            lines = [
                f"{m['worst_stage']} holds {w['param_mb']:.0f} MiB of weights "
                f"({w['param_mb'] / (m['full_weight_bytes'] / 2**20):.2f}× the full model) and {w['kv_mb']:.0f} MiB "
                f"of KV cache, but peaks {extra:.0f} MiB above both while loading: a transient of the order of its "
                f"largest tensor ({w['largest_param_mb']:.0f} MiB, the embedding or the LM head), most likely that "
                "tensor held twice for a moment (the memory-mapped checkpoint pages being copied, and the device "
                "buffer, which on this CPU backend is host memory too). Suggested: copy the vocabulary-sized "
                "tensors in row chunks into a preallocated device buffer (releasing each chunk's pages), so the "
                "transient is one chunk, not one tensor."]
            self.findings.append(("Peak RSS of a pp=2 stage (goal ≤ 0.6× full weights + baseline)", lines))
        return out

    def coldstart(self) -> list[str]:
        c = self.d["coldstart"]
        out = ["## Cold start of `pipejax generate`", ""]
        out += [f"{c['layout']}, a fresh process each time, what `pipejax generate` does (default KV sizing: "
                f"{c['kv_blocks']} blocks), to its first token; phases in wall-clock seconds from the process's "
                "creation, split by timestamps from the stage actors.", ""]
        total = c["total"]["median"]
        warm = c.get("warm_cache_phases")
        rows = [[p, fmt(s), f"{s['median'] / total:.0%}"] + ([fmt(warm[p])] if warm else [])
                for p, s in c["phases"].items()]
        rows.append(["**total**", fmt(c["total"]), ""] + ([fmt(c["warm_cache_total"])] if warm else []))
        out += md_table(["phase", "seconds (first start: empty compilation cache)", "share"]
                        + (["seconds (later start: cache filled)"] if warm else []), rows)
        comp = c["phases"]["compile (warm-up buckets)"]["median"]
        out += ["", f"Compilation is {comp / total:.0%} of a first start: the warm-up compiles every row bucket "
                "(decode) and token bucket (prefill) on each stage. The stage workers keep JAX's persistent "
                "compilation cache (`~/.cache/pipejax/jax-compilation`, or `$PIPEJAX_COMPILATION_CACHE_DIR`; empty "
                "turns it off), so later starts with the same model, layout and buckets load those programs "
                "instead" + (f": compile {warm['compile (warm-up buckets)']['median']:.1f} s." if warm else ".")]
        return out

    def profile_lines(self, section: str, prefix: str = "") -> list[str]:
        prof = self.d.get(section, {}).get("profile")
        if not prof:
            return []
        if "samples" in next(iter(prof.values()), {}):  # one process: thread -> summary
            prof = {"": prof}
        lines = []
        for proc, threads in prof.items():
            if not threads or not proc.startswith(prefix):
                continue
            lines.append(f"py-spy{f' ({proc})' if proc else ''} during one more run: share of the wall time each "
                         "thread was active (not blocked), and where its active samples were (innermost pipejax "
                         "line; a line that calls into JAX or a library carries that call's time):")
            for thread, s in list(threads.items())[:4]:
                top = "; ".join(f"`{name}` {share:.0%}" for name, share in s["top"][:4] if share >= 0.01)
                many = f" ×{s['threads']}" if s["threads"] > 1 else ""
                lines.append(f"  - thread `{thread}`{many}: active {s['active']:.0%} — {top}")
        return lines

    # --- assembling --------------------------------------------------------------------------------

    def render(self) -> str:
        meta = self.meta
        out = ["# pipejax benchmarks", "",
               "Generated by `nox -s bench_report` (benchmarks/report.py) — do not edit by hand; "
               "rerun it. Every figure sits next to its "
               "reference measured in the same run; numbers are medians over repeats with [min–max] (n=1: a single "
               "run). Benchmark model: the built-in `bench` checkpoint (Llama architecture, 124.7M parameters, "
               "fp32), on JAX's CPU backend.", ""]
        out += [f"- when: {meta.get('when', '?')}; took {meta.get('total_seconds', 0) / 60:.1f} min"
                f"{' (--quick)' if meta.get('quick') else ''}, {meta.get('repeats')} repeat(s)",
                f"- machine: {meta.get('machine', '?')}",
                f"- load average (1/5/15 min) at start: {_loads(meta.get('load_start'))}; at end: "
                f"{_loads(meta.get('load_end'))} — other work shares this machine, so figures are noisy; each "
                "section's own load at its start/end is listed at the bottom.",
                f"- versions: {meta.get('versions', '?')}", ""]
        out += ["## Summary", ""]
        out += md_table(["figure", "pipejax", "reference (same run)", "ratio", "goal", "verdict"], self.summary_rows())
        body = []
        for name in ("throughput", "decode", "pipeline", "executors", "transfer", "memory", "coldstart"):
            if name in self.d:
                body += [""] + getattr(self, name)()
        out += ["", "## Goals not met: what bounds them", ""]
        if self.findings:
            for title, lines in self.findings:
                out += [f"### {title}", ""]
                for line in lines:
                    out += [line if line.startswith("  - ") else f"- {line}"]
                out += [""]
        else:
            out += ["Every measured goal was met in this run.", ""]
        out += body
        failed = {k: v for k, v in meta.get("sections", {}).items() if v.get("rc") not in (0, None)}
        if failed:
            out += ["", "## Sections that failed", ""]
            for name, v in failed.items():
                out += [f"### {name} (exit {v['rc']})", "", "```", v.get("error", "").strip()[-1200:], "```", ""]
        out += ["", "## Run details", ""]
        rows = []
        for name in SECTIONS:
            if name in self.d:
                s = self.d[name]
                rows.append([name, f"{s.get('section_seconds', 0):.0f}", _loads(s.get("load_start")),
                             _loads(s.get("load_end"))])
        out += md_table(["section", "seconds", "load average at start", "at end"], rows)
        out += ["", "Reproduce: `nox -s bench_report` or `python benchmarks/report.py` "
                "(`--quick`: one repeat, fewer sizes); `--sections` runs a subset, `--from-results DIR` re-renders "
                "a run's JSON. Each section is also a module: "
                "`cd benchmarks && python -m pipejax_benchmarks.sections.<section> --json OUT`."]
        return "\n".join(out) + "\n"


def _loads(v) -> str:
    return "/".join(f"{x:.1f}" for x in v) if v else "?"


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
    for key, label, marker in (("pipejax_tps", "pipejax (pp1 tp1)", "o"), ("hf_tps", "transformers generate", "s")):
        med = [_key(t[key], c)["median"] for c in levels]
        lo = [m - _key(t[key], c)["min"] for m, c in zip(med, levels, strict=True)]
        hi = [_key(t[key], c)["max"] - m for m, c in zip(med, levels, strict=True)]
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


VECTOR_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile")  # what the matmul libraries can use


def machine() -> str:
    """CPUs (model; the vector extensions /proc/cpuinfo lists among ``VECTOR_FLAGS``), RAM, kernel."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read().splitlines()
        model = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
        flags = set(next((line.split(":", 1)[1].split() for line in info if line.startswith("flags")), []))
        model += "; " + (", ".join(f for f in VECTOR_FLAGS if f in flags) or "none of " + "/".join(VECTOR_FLAGS))
    except (OSError, StopIteration):
        model = platform.processor() or "?"
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} CPUs ({model}), {mem:.0f} GiB RAM, {platform.system()} {platform.release()}"


def versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    out = [f"python {platform.python_version()}"]
    for dist in ("jax", "jaxlib", "ray", "torch", "transformers", "pipejax-ray-executor"):
        try:
            out.append(f"{dist} {version(dist)}")
        except PackageNotFoundError:
            pass
    return ", ".join(out)


def run_report(args: argparse.Namespace) -> int:
    output = Path(args.output)
    plot_path = Path(args.plot) if args.plot else output.with_name("benchmarks_throughput.png")
    if args.from_results:
        results = Path(args.from_results)
        meta = json.loads((results / "meta.json").read_text()) if (results / "meta.json").exists() else {}
    else:
        names = [n.strip() for n in args.sections.split(",") if n.strip()]
        unknown = [n for n in names if n not in SECTIONS]
        if unknown:
            raise ValueError(f"unknown section(s) {unknown}; choose from {', '.join(SECTIONS)}")
        repeats = args.repeats or (1 if args.quick else 3)
        if repeats < 1:
            raise ValueError(f"--repeats={repeats} must be >= 1")
        results = Path(args.results_dir or tempfile.mkdtemp(prefix="pipejax-bench-report-"))
        results.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        meta = {"when": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
                "quick": args.quick, "repeats": repeats, "load_start": list(os.getloadavg()),
                "machine": machine(), "versions": versions()}
        meta.update(run_sections(names, results, repeats, args.quick, not args.no_profile))
        meta.update(load_end=list(os.getloadavg()), total_seconds=time.perf_counter() - start)
        (results / "meta.json").write_text(json.dumps(meta, indent=1))
    data = load_results(results)
    has_plot = plot(data, plot_path)
    rel = os.path.relpath(plot_path, output.parent) if has_plot else None
    kept = kept_sections(output.read_text()) if output.exists() else ""
    output.write_text(Report(data, meta, rel).render().rstrip("\n") + "\n" + ("\n" + kept if kept else ""))
    print(f"[bench report] wrote {output}" + (f" and {plot_path}" if has_plot else "") + f" (raw results: {results})")
    return 0 if all(v.get("rc") == 0 for v in meta.get("sections", {}).values()) else 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run_report(args)
    except ValueError as exc:  # user mistakes: one clear line
        print(f"report.py: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
