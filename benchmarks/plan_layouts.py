"""`pipejax plan`'s best layout against every valid layout measured: the plan's ranking held against the output tok/s
each layout serves on this host.

The plan is `pipejax plan --json` as a user runs it (with ``--measure``: from the model's parts timed here). Then
every layout it lists is served in turn by `pipejax serve` with the plan's own command as written (its split,
backend, max model length, rows and KV blocks), then loaded twice with the same ``--num-prompts`` requests of
``--input-len`` random tokens in and ``--output-len`` out, at most ``--concurrency`` at once (`pipejax bench
serve`; by default one wave, as the plan predicts): the first run compiles the shapes the load meets, the second
is timed, and its output tok/s is the measurement. Each server is a fresh
process group, stopped (SIGINT, then SIGKILL by its group id) before the next starts.

    python benchmarks/plan_layouts.py --devices 6 --measure --json OUT
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request


def pipejax_cmd() -> str:
    return shutil.which("pipejax") or os.path.join(os.path.dirname(sys.executable), "pipejax")


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
            return resp.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def bench(port: int, args: argparse.Namespace, prompts: int, out: str) -> dict:
    subprocess.run([pipejax_cmd(), "bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--num-prompts",
                    str(prompts), "--max-concurrency", str(args.concurrency), "--input-len", str(args.input_len),
                    "--output-len", str(args.output_len), "--output-json", out], check=True, capture_output=True,
                   timeout=1800)
    with open(out) as f:
        return json.load(f)


def serve_and_measure(command: list[str], args: argparse.Namespace, port: int, workdir: str) -> dict:
    log_path = os.path.join(workdir, f"serve-{port}.log")
    start = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([*command, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        while not healthy(port):
            if proc.poll() is not None or time.monotonic() - start > args.start_timeout:
                raise RuntimeError(f"{' '.join(command)}: not healthy (exit {proc.returncode}); see {log_path}")
            time.sleep(1)
        started = time.monotonic() - start
        bench(port, args, args.num_prompts, os.path.join(workdir, "warm.json"))  # the same load: its shapes compile
        figures = bench(port, args, args.num_prompts, os.path.join(workdir, "timed.json"))
        return {"start_s": round(started, 1), "figures": figures}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def output_tok_s(figures: dict) -> float:
    if figures["failed"]:
        raise RuntimeError(f"{figures['failed']} requests failed: {figures['errors']}")
    return float(figures["output_throughput"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="as for pipejax serve (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--devices", type=int, default=6, help="simulated devices on this host")
    ap.add_argument("--measure", action="store_true", help="plan from the model's parts measured here")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=64, help="one wave at --concurrency, as the plan predicts")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--port", type=int, default=18700)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    env_note = {"PIPEJAX_CPU_KERNEL_BUILD": "wait"}  # one formulation throughout the timed runs
    os.environ.update(env_note)
    workdir = tempfile.mkdtemp(prefix="plan-layouts-")
    plan_json = os.path.join(workdir, "plan.json")
    model_args = ["--model", args.model] if args.model else []
    plan_cmd = [pipejax_cmd(), "plan", *model_args, "--chips-per-host", str(args.devices), "--concurrency",
                str(args.concurrency), "--prompt-len", str(args.input_len), "--output-len", str(args.output_len),
                "--top", "100", "--json", plan_json, *(["--measure"] if args.measure else [])]
    started = time.monotonic()
    printed = subprocess.run(plan_cmd, check=True, capture_output=True, text=True).stdout
    print(" ".join(plan_cmd[1:]), f"({time.monotonic() - started:.0f} s)\n{printed}")
    with open(plan_json) as f:
        planned = json.load(f)
    from pipejax.ray_executor import plan

    work = plan.Workload(**planned["workload"])
    rows = []
    for rank, fields in enumerate(planned["layouts"], start=1):
        fields = {k: (tuple(v) if isinstance(v, list) else v) for k, v in fields.items() if k != "devices"}
        layout = plan.LayoutPrediction(**fields)
        command = [pipejax_cmd(), *plan.commands(layout, args.model, "", work)["pipejax"].split()[1:]]
        name = f"pp={layout.pp} tp={layout.tp} dp={layout.dp}"
        try:
            got = serve_and_measure(command, args, args.port + rank, workdir)
            measured = output_tok_s(got["figures"])
        except (RuntimeError, subprocess.SubprocessError) as exc:
            print(f"{name}: failed: {exc}")
            got, measured = {"error": str(exc)}, None
        rows.append({"rank": rank, "layout": name, "split": layout.partition, "predicted_tok_s": layout.throughput,
                     "measured_tok_s": measured, "start_s": got.get("start_s"), "command": " ".join(command[1:])})
        print(f"#{rank} {name} split {','.join(map(str, layout.partition))}: predicted {layout.throughput:.1f} tok/s, "
              f"measured {measured if measured is None else round(measured, 1)} tok/s", flush=True)
    done = [r for r in rows if r["measured_tok_s"]]
    best = max(done, key=lambda r: r["measured_tok_s"])
    chosen = rows[0]
    ratio = (chosen["measured_tok_s"] or 0.0) / best["measured_tok_s"]
    print(f"\nplan's best ({chosen['layout']}) serves {chosen['measured_tok_s']} tok/s; the best measured "
          f"({best['layout']}) {best['measured_tok_s']:.1f}: {ratio:.2f}x (goal >= 0.9x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"plan": " ".join(plan_cmd[1:]), "device": planned["device"], "rows": rows,
                       "plan_best_over_measured_best": ratio}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
