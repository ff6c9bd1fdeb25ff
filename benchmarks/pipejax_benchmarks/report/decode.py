"""The decode step against the machine's floor, and the prefill step against the matmul rate: the summary's rows
and the section (its findings' prose in ``prose``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .text import by_batch, fmt, key, md_table, probe_agrees, verdict

if TYPE_CHECKING:
    from .render import Report

from .prose import DECODE_64_GOAL, attention_kernel_line, other_libraries_lines, prefill_lines


def decode_rows(d: dict[str, Any]) -> list[list[str]]:
    """The summary table's rows of the decode section."""
    rows = []
    dd = d["decode"]
    x = key(dd["decode"], 64)
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
    return rows


def decode(report: Report) -> list[str]:
    """The section: the step against its floor by batch, the batch-64 step in parts and its implementations; the
    goals not met go to ``report.findings`` with what bounds them."""
    dd = report.d["decode"]
    out = _floor_table(dd)
    p = dd["parts_ms"]
    if "error" in p:
        return out + ["", f"(The step's parts could not be timed: {p['error']}.)"]
    report.findings.extend(_findings(dd))
    return out + _parts(dd)


def _floor_table(dd: dict[str, Any]) -> list[str]:
    """What the floors are measured from, then the step against its floor at each batch."""
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
    return out


def _parts(dd: dict[str, Any]) -> list[str]:
    """The batch-64 step in parts, and each CPU implementation of the runner against XLA's, alternated."""
    p = dd["parts_ms"]
    loop = dd.get("layer_loop_ms") or {}
    out: list[str] = []
    out += ["", "The step at batch 64, in parts (median ms): "
            f"host inputs {p['inputs']:.1f}, jitted forward {p['forward']:.1f}, sampling {p['sample']:.1f}; "
            f"the same model's dense matmuls alone (every weight once, batch 64, one jit; the median of the "
            f"alternated rounds below): "
            f"{dd['dense_matmuls_ms']:.1f} ms. Padded step shape (tokens, prefill rows, query, decode rows, "
            f"blocks, prefill blocks) = {p['shape']}."]
    x64 = key(dd["decode"], 64)
    if x64["ratio"]["median"] <= DECODE_64_GOAL:  # (over the goal, the finding below carries this cross-check)
        cross = other_libraries_lines(dd, x64)
        if cross:
            out += ["", "Cross-check of the floor's matmul rate. " + " ".join(cross)]
    if loop:
        out += ["", "The same dense matmuls read through a `lax.scan` over the layers' stacked weights (as the "
                "runner's layer loop reads them) against a loop over per-layer arrays, alternated, median ms: "
                + by_batch(loop, lambda t: f"scan {fmt(t['scan_ms'])}, per-layer arrays {fmt(t['per_layer_ms'])}")
                + ". The difference is the copy of each layer's weights that the scan's dynamic slice makes on "
                "XLA:CPU before its dots read them."]
    ab = dd.get("unrolled_vs_scan") or {}
    if ab:
        out += ["", "So the runner's decode steps on CPU run the layers unrolled over per-layer views of the "
                "stacked weights (`StageRunner(decode_layers=...)`, \"unrolled\" by default on CPU: each view "
                "aliases its layer's memory, nothing is copied); prefill steps keep the scan. The runner's "
                "decode step both ways, alternated, median ms: "
                + by_batch(ab, lambda t: f"unrolled {fmt(t['unrolled_ms'])}, scan {fmt(t['scan_ms'])}")
                + ". The first step of each (its compile included): "
                + by_batch(ab, lambda t: f"unrolled {t['unrolled_first_s']:.1f} s, scan {t['scan_first_s']:.1f} s")
                + "."]
    kab = dd.get("dense_kernel_vs_xla") or {}
    if kab:
        out += ["", "The runner's decode steps on CPU run their dense matmuls on a hand-written kernel "
                "(`StageRunner(dense_matmuls=...)`, \"cpu-kernel\" by default for float32 on CPU; "
                "`pipejax.runner.cpu.dense`, an XLA FFI custom call compiled by numba). The stage stores each "
                "dense weight in panels of 32 output columns (`panels.Panels`), so that the kernel streams a "
                "panel from contiguous memory while its 12 × 32 output tiles (AVX-512) stay in registers; prefill "
                "steps run on it too. The dense matmuls alone, same rounds, median ms: "
                + by_batch({n: t for n, t in loop.items() if t.get("kernel_ms")},
                            lambda t: f"kernel {fmt(t['kernel_ms'])}, XLA's dot {fmt(t['per_layer_ms'])}")
                + ". The runner's decode step both ways, alternated, median ms: "
                + by_batch(kab, lambda t: f"kernel {fmt(t['kernel_ms'])}, XLA's dot {fmt(t['xla_ms'])}")
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
    return out


def _findings(dd: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """(title, lines) for each decode or prefill goal not met: what bounds it, with the run's own numbers."""
    p = dd["parts_ms"]
    loop = dd.get("layer_loop_ms") or {}
    ab = dd.get("unrolled_vs_scan") or {}
    findings: list[tuple[str, list[str]]] = []
    one = key(dd["decode"], 1) if "1" in dd["decode"] or 1 in dd["decode"] else None
    if one and one["ratio"]["median"] > 1.3 and loop:
        t = key(loop, 1)
        scan_ms, per_layer_ms = t["scan_ms"]["median"], t["per_layer_ms"]["median"]
        findings.append(("Decode step at batch 1 vs floor (goal ≤ 1.3×)", [
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
            f"that copy: the step took {key(ab, 1)['unrolled_ms']['median']:.1f} ms that way against "
            f"{key(ab, 1)['scan_ms']['median']:.1f} ms as a layer scan, alternated. What remains above the "
            "floor is " + ("the kernel's" if dd.get("dense_matmuls") == "cpu-kernel" else "XLA:CPU's")
            + " matrix-vector products, which read the weights below the reduction's rate."
        ] if ab and ("1" in ab or 1 in ab) else [])))
    x = key(dd["decode"], 64)
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
        ] + other_libraries_lines(dd, x) + [
            f"Of the {p['forward']:.0f} ms forward, the weights' matmuls account for about "
            f"{dots_ms:.0f} ms; the other {rest:.0f} ms is attention over the paged KV cache "
            "(with the norms, RoPE and cache writes). "
            + (attention_kernel_line(dd) if dd.get("xla_attention_parts_ms") else
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
        findings.append(("Decode step vs floor (goal ≤ 1.5×)", lines))
    pf = dd.get("prefill")
    if pf and pf["share_of_matmul_rate"]["median"] < 0.85:
        findings.append(("2048-token prefill step vs JAX's matmul rate (goal ≥ 0.85×)",
                         prefill_lines(dd, pf)))
    return findings
