"""The driver of the multi-host test: runs inside the head's network namespace, joins RAY_ADDRESS.

    ip netns exec pj-h0 python run_multihost.py --hosts '[{"name": "pj-h0", "ip": ...}, ...]' \
        --workdir DIR --expect-order pj-h0,pj-h2,pj-h1

1. Greedy outputs of an in-process engine (this process's simulated XLA devices) for PROMPTS.
2. The Ray executor, PP x TP over the namespace hosts: every stage reports its host's namespace
   IP and hostname, ranks follow the rule (driver's node first, then nodes with fewer workers,
   then IP numerically), one process per stage, and the outputs equal the in-process ones.
3. A lost host: with requests in flight the driver asks the orchestrator (which can see every
   namespace) to kill the node that runs ``--victim-rank``'s stage. No host is spare, so the engine's
   recovery cannot re-place the stage: the driver measures how long until the engine raises
   ``EngineDeadError`` naming that stage, its host and why no node could take it (detection, then
   ``--recovery-timeout``).

The orchestrator is asked through files in ``--workdir`` (``driver_checks.ask``). The summary goes to
``summary.json`` there and, as the last line, to stdout. Exit status 0 when every check passed.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import sys
import time
import traceback
from collections import Counter
from pathlib import Path


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hosts", required=True, help='JSON list of {"name", "ip", "devices"}; the first is the head')
    ap.add_argument("--workdir", required=True, type=Path)
    ap.add_argument("--pp", type=int, default=3)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--expect-order", default="", help="comma-separated host names, one per rank (optional)")
    ap.add_argument("--victim-rank", type=int, default=1, help="the stage whose host is killed (-1: skip)")
    ap.add_argument("--recovery-timeout", type=float, default=15.0,
                    help="how long the engine tries to re-place the lost stage (no host is spare here)")
    ap.add_argument("--detect-limit-s", type=float, default=30.0, help="on top of --recovery-timeout")
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--ray-compiled-graph", action="store_true", help="the stages in a Ray Compiled Graph")
    ap.add_argument("--cut-only", action="store_true",
                    help="lose the host by cutting its link alone: its processes live on, unreachable")
    ap.add_argument("--spare", action="store_true",
                    help="a host is spare: the lost stage must move there and every request finish as without the loss")
    return ap.parse_args(argv)


ARGS = parse_args()
# Simulated devices must be configured before JAX is imported (the in-process reference needs pp*tp).
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={max(8, ARGS.pp * ARGS.tp)}"
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["RAY_AUTH_MODE"] = "disabled"

import ray  # noqa: E402
from driver_checks import Checks, ask  # noqa: E402  (this folder is on sys.path: run as a script)

from pipejax.ray_executor import LLM, SamplingParams  # noqa: E402
from pipejax.ray_executor.engine.engine import EngineDeadError  # noqa: E402

PROMPTS = ["Hello, pipejax!", "The quick brown fox", "pipelines", "x" * 40, "a", "tensor parallel", "hosts"]


def ip_key(ip: str) -> int:
    return int(ipaddress.ip_address(ip))


def expected_node_order(placement: list[dict], driver_node: str) -> list[str]:
    """The rule, written independently of pp_utils.rank_workers: driver's node, fewer workers, IP."""
    count = Counter(p["node_id"] for p in placement)
    ip = {p["node_id"]: p["ip"] for p in placement}
    return sorted(count, key=lambda n: (n != driver_node, count[n], ip_key(ip[n]), n))




def wait_for_nodes(hosts: list[dict], timeout_s: float = 60.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    want = {h["ip"] for h in hosts}
    while True:
        alive = [n for n in ray.nodes() if n["Alive"]]
        if want <= {n["NodeManagerAddress"] for n in alive} or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def main() -> int:
    hosts = json.loads(ARGS.hosts)
    by_ip = {h["ip"]: h for h in hosts}
    workdir: Path = ARGS.workdir
    check = Checks("driver")
    summary: dict = {"pp": ARGS.pp, "tp": ARGS.tp, "hosts": hosts, "timings": {}}
    greedy = SamplingParams(temperature=0, max_tokens=ARGS.max_tokens, ignore_eos=True)
    llm = None
    try:
        # 1. The reference: the in-process executor on this process's simulated devices.
        t0 = time.monotonic()
        ref = LLM("builtin", pipeline_parallel_size=ARGS.pp, tensor_parallel_size=ARGS.tp, num_kv_blocks=128,
                  warmup=False)
        expected = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, greedy)]
        ref.shutdown()
        del ref
        summary["timings"]["inprocess_s"] = round(time.monotonic() - t0, 2)

        # 2. The Ray executor across the namespace hosts.
        t0 = time.monotonic()
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
        alive = wait_for_nodes(hosts)
        check("all hosts joined", {n["NodeManagerAddress"] for n in alive} >= set(by_ip),
              f"alive: {sorted(n['NodeManagerAddress'] for n in alive)}")
        driver_node = ray.get_runtime_context().get_node_id()
        driver_ip = ray.util.get_node_ip_address()
        check("driver runs on the head host", driver_ip == hosts[0]["ip"], f"driver ip {driver_ip}")
        llm = LLM("builtin", pipeline_parallel_size=ARGS.pp, tensor_parallel_size=ARGS.tp,
                  distributed_executor_backend="ray", num_kv_blocks=128, warmup=False,
                  ray_compiled_graph=ARGS.ray_compiled_graph, recovery_timeout=ARGS.recovery_timeout)
        summary["timings"]["ray_engine_start_s"] = round(time.monotonic() - t0, 2)
        placement = llm.engine.executor.placement
        summary["placement"] = placement
        node_ip = {n["NodeID"]: n["NodeManagerAddress"] for n in alive}
        check("each stage reports its node's namespace IP",
              all(p["ip"] in by_ip and node_ip.get(p["node_id"]) == p["ip"] for p in placement),
              str([(p["ip"], p["node_id"][:8]) for p in placement]))
        check("each stage reports its namespace's hostname",
              all(p["host"] == by_ip[p["ip"]]["name"] for p in placement if p["ip"] in by_ip),
              str([(p["host"], p["ip"]) for p in placement]))
        check("one process per stage", len({(p["node_id"], p["pid"]) for p in placement}) == ARGS.pp)
        nodes = [p["node_id"] for p in placement]
        runs = [n for i, n in enumerate(nodes) if i == 0 or nodes[i - 1] != n]
        check("ranks contiguous per node", len(runs) == len(set(runs)), str(nodes))
        check("local ranks count up per node",
              all([p["local_rank"] for p in placement if p["node_id"] == n] == list(range(nodes.count(n)))
                  and {p["local_world_size"] for p in placement if p["node_id"] == n} == {nodes.count(n)}
                  for n in set(nodes)))
        check("ranks follow the rule: driver's node, fewer workers, IP",
              runs == expected_node_order(placement, driver_node), f"got {[node_ip.get(n) for n in runs]}")
        order = [p["host"] for p in placement]
        summary["rank_hosts"] = order
        if ARGS.expect_order:
            want = ARGS.expect_order.split(",")
            check("ranks in the expected host order", order == want, f"got {order}, want {want}")

        t0 = time.monotonic()
        outputs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)]
        summary["timings"]["ray_generate_s"] = round(time.monotonic() - t0, 2)
        check("greedy outputs equal the in-process executor's", outputs == expected,
              "" if outputs == expected else f"got {outputs}, want {expected}")

        # 3. Lose the host of one stage while requests are in flight.
        if ARGS.victim_rank >= 0 and ARGS.spare:
            heal_onto_a_spare(llm, ARGS.victim_rank, workdir, check, summary)
        elif ARGS.victim_rank >= 0:
            lose_a_host(llm, ARGS.victim_rank, workdir, check, summary)
    except Exception as exc:  # a crash is a failed check, and still gives a summary
        traceback.print_exc()
        check("no unexpected exception", False, f"{type(exc).__name__}: {exc}")
    finally:
        if llm is not None:
            try:
                t0 = time.monotonic()
                llm.shutdown()
                summary["timings"]["shutdown_s"] = round(time.monotonic() - t0, 2)
            except Exception as exc:
                check("shutdown after the loss", False, f"{type(exc).__name__}: {exc}")
        if ray.is_initialized():
            ray.shutdown()
    summary["checks"] = check.results
    summary["notes"] = check.notes
    summary["ok"] = all(check.results.values())
    text = json.dumps(summary, default=str)
    (workdir / "summary.json").write_text(text)
    print(text, flush=True)
    return 0 if summary["ok"] else 1


def _request_kill(workdir: Path, victim: dict, rank: int, check: Checks) -> float | None:
    """Ask the orchestrator to lose ``victim``'s host; the time.time() at which it began (None: it did not)."""
    killed_at = ask(workdir, "cut" if ARGS.cut_only else "lose", rank=rank, ip=victim["ip"], host=victim["host"])
    check("the orchestrator lost the host", killed_at is not None, "no answer within 180 s")
    return killed_at


def heal_onto_a_spare(llm, rank: int, workdir: Path, check: Checks, summary: dict) -> None:
    """Requests in flight, the host of stage ``rank`` lost, a host spare: the engine moves the stage there and
    every request finishes with the tokens of the same requests run before without the loss."""
    engine = llm.engine
    victim = dict(engine.executor.placement[rank])
    long = SamplingParams(temperature=0, max_tokens=160, ignore_eos=True)
    prompts = [f"request {i} across hosts" for i in range(8)]
    clean = [o.outputs[0].token_ids for o in llm.generate(prompts, long)]
    ids = [f"healed-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, long)
    for _ in range(6):
        engine.step()
    killed_at = _request_kill(workdir, victim, rank, check)
    if killed_at is None:
        return
    done, first_after = {}, None
    try:
        while engine.has_unfinished_requests() and time.time() - killed_at < 180:
            for out in engine.step():
                if first_after is None and engine.recovery.recoveries:
                    first_after = time.time() - killed_at
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
    except EngineDeadError as exc:
        check("the engine heals instead of failing", False, str(exc)[-600:])
        return
    summary["timings"]["loss_to_next_token_s"] = round(first_after or -1, 2)
    summary["timings"]["recovery"] = {k: round(v, 2) for k, v in engine.recovery.last_phases.items()}
    now = engine.executor.placement[rank]
    summary["healed_onto"] = now["host"]
    check("one recovery", engine.recovery.recoveries == 1, str(engine.recovery))
    check("the stage moved to the spare host", now["ip"] != victim["ip"], f"{victim['host']} -> {now['host']}")
    check("every request finished as without the loss", [done.get(i) for i in ids] == clean,
          f"{sum(done.get(i) == c for i, c in zip(ids, clean, strict=True))}/{len(ids)} equal")
    check("the next token came within 30 s of the loss", first_after is not None and first_after < 30,
          f"{first_after}")


def lose_a_host(llm, rank: int, workdir: Path, check: Checks, summary: dict) -> None:
    engine = llm.engine
    victim = engine.executor.placement[rank]
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    ids = [f"lost-{i}" for i in range(4)]
    for rid in ids:
        engine.add_request(rid, f"request {rid}", long)
    for _ in range(6):
        engine.step()
    killed_at = _request_kill(workdir, victim, rank, check)
    if killed_at is None:
        return
    error = None
    try:
        while engine.has_unfinished_requests() and time.time() - killed_at < 120:
            engine.step()
    except EngineDeadError as exc:
        error = exc
    detect_s = time.time() - killed_at
    summary["timings"]["detect_s"] = round(detect_s, 2)
    summary["error"] = str(error)
    check("a lost host raises EngineDeadError", error is not None, f"after {detect_s:.1f}s")
    if error is None:
        return
    name = f"stage {rank} (host {victim['host']}, ip {victim['ip']}"
    check("the error names the lost stage and host", name in str(error), f"want {name!r} in {str(error)!r}")
    limit = ARGS.detect_limit_s + ARGS.recovery_timeout
    check(f"failed within {limit:.0f}s (detection, then the recovery timeout)", detect_s < limit, f"{detect_s:.1f}s")
    check("the error says no node could take the stage", "recovery failed" in str(error)
          and f"no node could take stage {rank} " in str(error), str(error)[-400:])
    failed = {o.request_id: o.outputs[0] for o in error.failed_outputs}
    check("every in-flight request failed with the error",
          sorted(failed) == ids and all(o.finish_reason == "error" for o in failed.values()),
          str({k: o.finish_reason for k, o in failed.items()}))
    try:
        engine.add_request("late", "too late", long)
        check("a dead engine refuses new work", False)
    except EngineDeadError:
        check("a dead engine refuses new work", True)


if __name__ == "__main__":
    sys.exit(main())
