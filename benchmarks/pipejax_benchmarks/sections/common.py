"""What every benchmark section shares: statistics, the section entry point, machine rates, the
benchmark model's engine settings, and a py-spy self-profiler whose samples are summarised per thread."""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# Every figure from one formulation throughout: stages wait for CPU kernels numba has not built yet, rather than
# switching to them mid-run (the engines' default "background" build).
os.environ.setdefault("PIPEJAX_CPU_KERNEL_BUILD", "wait")

# The workload of the headline figure: 64 requests x 128 prompt tokens x 64 output tokens.
NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 64, 128, 64
BLOCK_SIZE = 16
MAX_MODEL_LEN = 256  # room for 128 + 64; bounds the KV block bucket (and so the compiled shapes)
# The timer, this machine's rates (the floor's denominators), the summary statistics and the engine-in-a-process
# helper are the runner layer's benchmark helpers, shared with its decode benchmarks: imported from that folder.
RUNNER_BENCHMARKS = Path(__file__).resolve().parents[3] / "packages" / "runner" / "benchmarks"
sys.path.insert(0, str(RUNNER_BENCHMARKS))
# (re-exported to the sections)
from bench_support import EngineProcess, summary  # noqa: E402, F401
from machine_floor import CONTEXT, kv_bytes, machine_rates, matmul_rate, step_cost, timed  # noqa: E402, F401


def prompts(num: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Random token-id prompts (the same ``pipejax bench throughput`` uses)."""
    rng = random.Random(seed)
    return [[rng.randrange(0, min(vocab, 256)) for _ in range(length)] for _ in range(num)]


def bench_model() -> str:
    """The 124M-parameter fp32 benchmark checkpoint (generated on first use)."""
    from pipejax.ray_executor.engine_args import environment_defaults, resolve_model

    return resolve_model("builtin:bench", environment_defaults(os.environ).get("model_cache_dir"))


def engine_buckets(llm):
    """The padding buckets the engine's stages run at, from its config (``pipejax.runner.inputs.Buckets``)."""
    from pipejax.runner.inputs import Buckets

    config = llm.engine.config
    limits = config.scheduler
    return Buckets.make(limits.max_num_batched_tokens, limits.max_num_seqs, llm.engine.max_model_len,
                        config.cache.block_size)


def stage_pids(llm) -> list[int]:
    """The process of each stage, by pp rank (this one for the in-process engine)."""
    return [info.pid for info in llm.engine.executor.stage_infos()]


def compiled_shapes(llm) -> int:
    """Step shapes the engine's stages have compiled so far, summed over the stages."""
    return sum(llm.engine.executor.collective_rpc("num_compiled_shapes"))


def engine_kwargs(max_num_seqs: int = NUM_PROMPTS, max_num_batched_tokens: int = 2048) -> dict[str, Any]:
    """LLM settings of every section: an explicit KV cache sized for the workload (not from free memory), and
    step traces kept (a few thousand steps: every section's timed runs)."""
    per_request = -(-MAX_MODEL_LEN // BLOCK_SIZE)
    return {
        "block_size": BLOCK_SIZE,
        "num_kv_blocks": 1 + max_num_seqs * per_request,
        "max_model_len": MAX_MODEL_LEN,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "step_trace_len": 1 << 14,
    }


def load_average() -> list[float]:
    return list(os.getloadavg())


def machine_cpu() -> tuple[int, int]:
    """(busy, total) CPU jiffies of the whole machine so far, from /proc/stat (Linux; (0, 0) elsewhere)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return 0, 0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


class CpuMeter:
    """Cores this process kept busy, and the share of the whole machine's CPU that was busy (anyone's),
    between ``start()`` and ``stop()``."""

    def start(self) -> CpuMeter:
        self._cpu, self._wall, self._machine = cpu_seconds(), time.perf_counter(), machine_cpu()
        return self

    def stop(self) -> dict[str, float]:
        wall = time.perf_counter() - self._wall
        busy, total = (b - a for a, b in zip(self._machine, machine_cpu(), strict=True))
        return {"cores": (cpu_seconds() - self._cpu) / wall, "machine_busy": busy / total if total else float("nan")}


def cpu_seconds() -> float:
    """CPU time (user + system, every thread) this process has used so far."""
    t = os.times()
    return t.user + t.system


def process_cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of process ``pid`` so far, from /proc (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# --- the section entry point -------------------------------------------------------------------


def section_main(run: Callable[[argparse.Namespace], dict[str, Any]], doc: str, argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--json", required=True, help="write the figures here")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats (median and min-max reported)")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    parser.add_argument("--profile-dir", default=None, help="py-spy a profiled run into this folder (where sensible)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    result = {"load_start": load_average()}
    result.update(run(args))
    result.update(load_end=load_average(), section_seconds=time.perf_counter() - start)
    Path(args.json).write_text(json.dumps(result, indent=1))


# --- profiling ---------------------------------------------------------------------------------


def py_spy() -> str | None:
    """The py-spy next to this interpreter, or on PATH."""
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.exists() else shutil.which("py-spy")


class Profile:
    """What ``self_profile`` recorded: the raw file, how long, at what rate, and whether it ran."""

    def __init__(self, path: str | Path | None, rate: int):
        self.path, self.rate, self.seconds, self.ok = path, rate, 0.0, False

    def summary(self, top: int = 6) -> dict[str, Any] | None:
        return summarize_profile(self.path, self.seconds * self.rate, top) if self.ok else None


@contextlib.contextmanager
def self_profile(path: str | Path | None, rate: int = 100, pid: int | None = None) -> Iterator[Profile]:
    """py-spy samples this process (or ``pid``) while the block runs: Python stacks of every thread,
    only while a thread is active (py-spy drops idle samples), without pausing the process. Raw
    collapsed stacks go to ``path``; ``Profile.summary()`` reads them."""
    prof = Profile(path, rate)
    exe = py_spy() if path else None
    if exe is None:
        yield prof
        return
    cmd = [exe, "record", "--pid", str(pid or os.getpid()), "--rate", str(rate), "--format", "raw", "-o", str(path),
           "--threads", "--nonblocking"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(1.0)  # attach
    if proc.poll() is not None:  # e.g. no ptrace permission: the benchmark goes on without a profile
        print(f"py-spy could not attach: {proc.stderr.read().strip()[-300:]}", file=sys.stderr)
        yield prof
        return
    start = time.perf_counter()
    try:
        yield prof
    finally:
        prof.seconds = time.perf_counter() - start
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
            prof.ok = proc.returncode == 0 and Path(path).exists()
        except subprocess.TimeoutExpired:
            proc.kill()


_FRAME = re.compile(r"^(?P<func>.+?) \((?P<file>[^()]+?)\)$")
OWN_CODE = ("ray_executor/", "runner/", "worker/", "pp_utils/", "torchax_bridge/")


def _own_files() -> set[str]:
    """Base names of pipejax's modules (py-spy shortens some paths to the bare file name)."""
    import pipejax

    names = {f.name for root in pipejax.__path__ for f in Path(root).rglob("*.py")}
    return names - {"__init__.py", "config.py", "cli.py", "bench.py", "utils.py"}


def summarize_profile(path: str | Path, expected: float, top: int = 6) -> dict[str, Any]:
    """Per thread: the share of wall time it was active (samples / ``expected`` samples), and what it
    was doing then: the innermost pipejax frame of each sample (file:line, so a line that calls into
    JAX or a library carries that call's time), as shares of the thread's active samples."""
    threads: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    totals: dict[str, int] = collections.Counter()
    ids: dict[str, set] = collections.defaultdict(set)
    own_files = _own_files()
    for line in Path(path).read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        m = re.match(r"^thread \((\w+)\): ?(.*)$", frames[0])
        tid, thread = (m[1], m[2]) if m else ("?", frames[0])
        thread = re.sub(r"\d+$", "N", thread or "thread")  # pool threads: one row for all of them
        own, leaf = None, None
        for frame in frames[1:]:
            fm = _FRAME.match(frame)
            if not fm:
                continue
            leaf = f"{fm['func']} ({fm['file']})"
            file = fm["file"].rsplit(":", 1)[0]
            if file.startswith(OWN_CODE) or file in own_files:
                own = leaf
        key = own or (f"[{leaf}]" if leaf else "[?]")
        threads[thread][key] += n
        totals[thread] += n
        ids[thread].add(tid)
    out = {}
    for thread, counter in sorted(threads.items(), key=lambda kv: -totals[kv[0]]):
        total = totals[thread]
        rows = [(k, v / total) for k, v in counter.most_common(top)]
        active = total / (expected * len(ids[thread])) if expected else float("nan")
        out[thread] = {"samples": total, "threads": len(ids[thread]), "active": active, "top": rows}
    return out
