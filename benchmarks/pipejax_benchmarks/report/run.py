"""Running the report: each section in its own process, its JSON kept, then the report rendered and written."""


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
from pathlib import Path
from typing import Any

from .catalog import SECTIONS
from .plot import plot
from .render import Report

SECTION_TIMEOUT_S = 1800
BENCH_DIR = Path(__file__).resolve().parents[2]  # benchmarks/: holds pipejax_benchmarks/
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
