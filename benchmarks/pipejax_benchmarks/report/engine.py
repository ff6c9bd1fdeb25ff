"""The engine-level sections: pp=2 batches in flight, the executors, the activation transfer, a stage's memory and
the cold start (the summary's rows and each section)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from .text import fmt, key, md_table, verdict

if TYPE_CHECKING:
    from .render import Report


def pipeline_rows(d: dict[str, Any]) -> list[list[str]]:
    """The summary table's rows of the pipeline section."""
    rows = []
    p = d["pipeline"]
    rows.append(["pp=2 output tokens/s, 2 batches in flight (each stage on its own cores)",
                 fmt(key(p["tps"], 2)),
                 f"same engine, 1 batch in flight: {fmt(key(p['tps'], 1))}", fmt(p["ratio"], 2, "×"),
                 "≥ 1.6×", verdict(p["ratio"], 1.6, True)])
    return rows


def executors_rows(d: dict[str, Any]) -> list[list[str]]:
    """The summary table's rows of the executors section."""
    rows = []
    e = d["executors"]
    rows.append(["Ray executor step (pp1 tp1, batch 32 decode, ms)", fmt(e["step_ms"]["ray"]),
                 f"in-process executor: {fmt(e['step_ms']['in-process'])}", fmt(e["ratio_ray"], 3, "×"),
                 "≤ 1.10×", verdict(e["ratio_ray"], 1.10, False)])
    rows.append(["compiled-graph step (same, ms)", fmt(e["step_ms"]["ray compiled graph"]),
                 f"plain Ray calls: {fmt(e['step_ms']['ray'])}", fmt(e["ratio_cg"], 3, "×"), "≤ 1.0×",
                 verdict(e["ratio_cg"], 1.0, False)])
    return rows


def transfer_rows(d: dict[str, Any]) -> list[list[str]]:
    """The summary table's rows of the transfer section."""
    rows = []
    for label, s in d["transfer"]["sizes"].items():
        rows.append([f"cross-process activation transfer, {label}: GB/s (latency ms)",
                     f"{fmt(s['gbps']['transport'], 2)} ({s['latency_ms']['transport']['median']:.3f} ms)",
                     f"raw ZMQ PUSH/PULL, same bytes, same processes: {fmt(s['gbps']['zmq'], 2)} "
                     f"({s['latency_ms']['zmq']['median']:.3f} ms)",
                     fmt(s["ratio"], 2, "×"), "≥ 0.8×", verdict(s["ratio"], 0.8, True)])
    return rows


def memory_rows(d: dict[str, Any]) -> list[list[str]]:
    """The summary table's rows of the memory section."""
    rows = []
    m = d["memory"]
    w = m["probes"][m["worst_stage"]]
    full = m["full_weight_bytes"] / 2**20
    rows.append([f"peak RSS of a pp=2 stage worker while loading ({m['worst_stage']}), MiB over the "
                 f"process baseline ({w['base_mb']['median']:.0f} MiB)", fmt(w["load_growth_mb"], 0),
                 f"full model weights: {full:.0f} MiB", fmt(w["ratio"], 3, "×"), "≤ 0.6× (+ baseline)",
                 verdict(w["ratio"], 0.6, False)])
    return rows


def coldstart_rows(d: dict[str, Any]) -> list[list[str]]:
    """The summary table's rows of the coldstart section."""
    rows = []
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


def pipeline(report: Report) -> list[str]:
    p = report.d["pipeline"]
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
            rows.append([name, depth, fmt(key(v["tps"], depth)), fmt(key(v["cores_busy"], depth), 2),
                         fmt({k: x * 100 if isinstance(x, float) else x
                              for k, x in key(v["machine_busy"], depth).items()}, 0, "%"),
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
        c2, c1 = key(shared["cores_busy"], 2)["median"], key(shared["cores_busy"], 1)["median"]
        out += ["", f"With shared cores the second batch in flight adds {shared['ratio']['median']:.2f}×: with one "
                f"batch in flight the engine already kept {c1:.2f} of the {p['cpus']} cores busy (XLA spreads "
                f"each stage's work over all of them), with two {c2:.2f}; the second batch can only fill the "
                "gaps the host-side work of a step leaves. That is a bound of the machine, not of the schedule."]
    if p["ratio"]["median"] < 1.6:
        c2, c1 = key(p["cores_busy"], 2)["median"], key(p["cores_busy"], 1)["median"]
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
        report.findings.append(("pp=2 throughput, 2 in flight vs 1 (goal ≥ 1.6×)",
                              lines + report.profile_lines("pipeline")))
    return out



def executors(report: Report) -> list[str]:
    e = report.d["executors"]
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
        report.findings.append(("Ray executor step vs in-process (goal ≤ 1.10×)",
                              lines + report.profile_lines("executors", prefix="ray:")))
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
        report.findings.append(("Compiled-graph step vs plain Ray (goal ≤ 1.0×)",
                              lines + report.profile_lines("executors", prefix=f"{cg}:")))
    return out



def transfer(report: Report) -> list[str]:
    t = report.d["transfer"]
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
        report.findings.append(("Cross-process activation transfer (goal ≥ 0.8× ZMQ's GB/s)", lines))
    return out



def memory(report: Report) -> list[str]:
    m = report.d["memory"]
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
        report.findings.append(("Peak RSS of a pp=2 stage (goal ≤ 0.6× full weights + baseline)", lines))
    return out



def coldstart(report: Report) -> list[str]:
    c = report.d["coldstart"]
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

