"""How long a lost stage takes to heal, part by part, and the throughput dip around it.

Each case runs in a fresh process: ``LLM(model, pipeline_parallel_size=2, distributed_executor_backend="ray")``
with default settings otherwise, on a local Ray cluster. A first generate fills JAX's persistent compilation
cache (the "warm cache" the goal is stated for); then ``--requests`` greedy requests of ``--output-len`` tokens
run, and once each has a few tokens the process of stage ``--victim`` is killed (SIGKILL). The engine notices,
replaces the stage and prefills the requests again. ``--loss host`` removes the stage's whole node instead, from a
simulated cluster (``ray.cluster_utils``) with a spare node, where Ray moves the stage's bundle. Reported, from
the loss:

- detection: until the engine starts recovering (the step's Ray error, or a ping unanswered);
- find / drain / place / load / connect: ``RayExecutor.recover``'s phases (placement = a new actor in the
  stage's placement-group bundle; load = its weights and KV cache);
- compile: the new stage's XLA programs for the first steps after it (from the persistent cache: its own
  ``compile_stats``);
- re-prefill: the rest of the time to the next new token (the requests' prompts + generated tokens again);
- loss -> next token: the whole gap, the goal's figure (<= 30 s with a warm cache, default model, pp=2);
- the throughput dip: tokens/s in 1 s windows before and after.

    python benchmarks/recovery_bench.py                       # default model, 16 requests
    python benchmarks/recovery_bench.py --models default builtin --requests 4 16 64
    python benchmarks/recovery_bench.py --loss process host
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time


def _cluster_with_a_spare():
    """A Ray cluster of simulated nodes on this machine (``ray.cluster_utils``): a head without devices and three
    nodes of one device each, so a pp=2 engine leaves one node spare; this process joins it."""
    import ray
    from ray.cluster_utils import Cluster

    from pipejax.ray_executor.config import CPU_DEVICE_RESOURCE

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    nodes = [cluster.add_node(num_cpus=1, resources={CPU_DEVICE_RESOURCE: 1}) for _ in range(3)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    return cluster, nodes


def one_case(model: str, requests: int, output_len: int, victim: int, host_loss: bool = False) -> dict:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from pipejax.ray_executor import LLM, SamplingParams

    cluster, nodes = _cluster_with_a_spare() if host_loss else (None, [])
    llm = LLM(None if model == "default" else model, pipeline_parallel_size=2, distributed_executor_backend="ray")
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    prompts = [f"Request {i}: tell me a long story about the number {i}." for i in range(requests)]
    llm.generate(prompts, params)  # compiles this workload's shapes into the persistent cache
    victim_place = dict(engine.executor.placement[victim])
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    timeline, killed_at = [], None  # (time, new tokens) per step
    while engine.has_unfinished_requests():
        outputs = engine.step_deltas()
        now = time.monotonic()
        timeline.append((now, sum(len(d.new_token_ids) for d in outputs)))
        if killed_at is None and len(engine.scheduler.running) == requests and \
                all(len(r.output_token_ids) >= output_len // 3 for r in engine.scheduler.running):
            killed_at = time.monotonic()
            if host_loss:  # the node's raylet and daemons (its workers would notice only later)
                cluster.remove_node(next(n for n in nodes if n.node_id == victim_place["node_id"]), False)
            os.kill(victim_place["pid"], signal.SIGKILL)  # a stage actor this process's cluster started
    stats = engine.recovery
    if stats.recoveries != 1:
        raise RuntimeError(f"expected one recovery, got {stats}")
    healed_at = stats.last_started + stats.last_phases["total"]
    next_token = next(t for t, n in timeline if t > healed_at and n > 0)
    new_stage = engine.executor.collective_rpc("compile_stats")[victim]  # the replacement's programs so far
    window = 2.0
    before = [n for t, n in timeline if killed_at - window <= t < killed_at]
    after = [n for t, n in timeline if next_token <= t < next_token + window]
    out = {
        "model": engine.config.model.path.rsplit("/", 1)[-1], "requests": requests, "victim": victim,
        "loss": "host" if host_loss else "process",
        "layers": engine.model_config.num_layers, "hidden": engine.model_config.hidden_size,
        "detection_s": stats.last_started - killed_at,
        **{f"{k}_s": v for k, v in stats.last_phases.items() if k != "total"},
        "recover_total_s": stats.last_phases["total"],
        "compile_s": new_stage.seconds, "programs": new_stage.programs, "cache_hits": new_stage.cache_hits,
        "re_prefill_s": max(0.0, next_token - healed_at - new_stage.seconds),
        "loss_to_next_token_s": next_token - killed_at,
        "tok_s_before": sum(before) / window, "tok_s_after": sum(after) / window,
    }
    llm.shutdown()
    if cluster is not None:
        import ray

        ray.shutdown()
        cluster.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["default"], help="'default' (SmolLM2-135M), 'builtin', a path")
    ap.add_argument("--requests", nargs="+", type=int, default=[16])
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--victim", type=int, default=1, help="pp rank whose process is killed")
    ap.add_argument("--loss", nargs="+", choices=["process", "host"], default=["process"],
                    help="kill the stage's process (SIGKILL), or remove its whole node from a simulated cluster "
                         "that has a spare node")
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)  # one case, in a child process
    args = ap.parse_args()
    if args.case:
        print("RESULT " + json.dumps(one_case(**json.loads(args.case))), flush=True)
        return
    rows = []
    cases = [(m, r, loss) for loss in args.loss for m in args.models for r in args.requests]
    for model, requests, loss in cases:
        case = {"model": model, "requests": requests, "output_len": args.output_len, "victim": args.victim,
                "host_loss": loss == "host"}
        proc = subprocess.run([sys.executable, __file__, "--case", json.dumps(case)], capture_output=True,
                              text=True, timeout=900)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not lines:
            raise SystemExit(f"case {case} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        rows.append(json.loads(lines[-1].removeprefix("RESULT ")))
        print(json.dumps(rows[-1]), flush=True)
    cols = ["loss", "model", "requests", "detection_s", "find_s", "drain_s", "place_s", "load_s", "connect_s",
            "compile_s", "re_prefill_s", "loss_to_next_token_s", "tok_s_before", "tok_s_after"]
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")


if __name__ == "__main__":
    main()
