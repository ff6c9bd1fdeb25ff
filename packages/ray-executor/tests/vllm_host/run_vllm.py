"""One engine run in a fresh process: vLLM's own ``LLM`` on pipejax's platform.

    python run_vllm.py '<json spec>'   -> prints one line ``RESULT <json>``

Spec: model, pp, tp, backend, prompt batches (lists of token-id
lists, generated one batch after the other), optional texts and a chat (through vLLM's tokenizer), max_tokens, and
vLLM options (num_gpu_blocks_override,
max_num_batched_tokens). A Ray run starts a local cluster that declares one ``TPU`` resource per
stage (what vLLM's Ray executors place workers by) and shares it with vLLM's engine core process.
"""

from __future__ import annotations

import json
import os
import sys


def run_vllm(spec: dict) -> dict:
    import vllm

    ray = None
    if spec["backend"] == "ray":
        import ray

        ctx = ray.init(address="local", resources={"TPU": spec["pp"]}, include_dashboard=False)
        os.environ["RAY_ADDRESS"] = ctx.address_info["address"]  # the engine core process joins it
    llm = vllm.LLM(
        model=spec["model"],
        pipeline_parallel_size=spec["pp"],
        tensor_parallel_size=spec["tp"],
        distributed_executor_backend=spec["backend"],
        dtype=spec.get("dtype", "float32"),
        max_model_len=spec.get("max_model_len", 256),
        max_num_seqs=16,
        max_num_batched_tokens=spec.get("max_num_batched_tokens", 64),  # long prompts prefill in chunks
        enable_prefix_caching=True,
        num_gpu_blocks_override=spec.get("num_gpu_blocks_override"),
        seed=0,
        enable_expert_parallel=spec.get("expert_parallel", False),
        quantization=spec.get("quantization"),
    )
    try:
        if "kill_stage" in spec:
            return _kill_stage_while_generating(llm, spec)
        params = vllm.SamplingParams(temperature=0, max_tokens=spec["max_tokens"], ignore_eos=True)
        result = {"outputs": []}
        for batch in spec.get("batches", []):
            done = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
            result["outputs"].append([list(o.outputs[0].token_ids) for o in done])
        if "texts" in spec:  # through vLLM's own tokenizer
            done = llm.generate(spec["texts"], params, use_tqdm=False)
            result["texts"] = [{"prompt": o.prompt_token_ids, "output": list(o.outputs[0].token_ids)} for o in done]
        if "chat" in spec:  # vLLM's chat template and stop tokens
            done = llm.chat(spec["chat"], vllm.SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)
            out = done[0].outputs[0]
            result["chat"] = {"text": out.text, "finish_reason": out.finish_reason, "output": list(out.token_ids)}
        result["stats"] = llm.collective_rpc("pipejax_stats")
        if os.environ.get("VLLM_USE_RAY_V2_EXECUTOR_BACKEND") == "0":  # a function: VLLM_ALLOW_INSECURE_SERIALIZATION
            result["zmq_edge_ends"] = llm.collective_rpc(_zmq_edge_ends)
        return result
    finally:
        try:
            llm.llm_engine.engine_core.shutdown()  # before Ray goes: the engine core still uses the cluster
        except Exception:  # noqa: BLE001 - an engine killed by the test is already gone
            pass
        if ray is not None:
            ray.shutdown()


def _zmq_edge_ends(worker) -> int:
    """In a worker: the compiled-graph edge ends on pipejax's zmq channel this process holds (0: none, or no
    compiled graph)."""
    graph_channel = sys.modules.get("pipejax.ray_executor.executor.graph_channel")
    return graph_channel.edge_ends_here() if graph_channel else 0


def _kill_stage_while_generating(llm, spec: dict) -> dict:
    """SIGKILL the worker process of pipeline stage ``spec["kill_stage"]`` while a long generate runs; what the
    generate raised, and how long after the kill."""
    import signal
    import threading
    import time

    import vllm

    victim = next(s for s in llm.collective_rpc("pipejax_stats") if s["pp_rank"] == spec["kill_stage"])
    params = vllm.SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    killed = {}

    def kill():
        time.sleep(spec.get("kill_after_s", 2.0))
        killed["at"] = time.monotonic()
        os.kill(victim["pid"], signal.SIGKILL)  # a worker process this run's engine started

    threading.Thread(target=kill, daemon=True).start()
    try:
        llm.generate([{"prompt_token_ids": p} for p in spec["batches"][0]] * 4, params, use_tqdm=False)
        outcome = {"error": None}
    except Exception as e:  # noqa: BLE001 - reported to the test
        outcome = {"error": type(e).__name__, "module": type(e).__module__, "message": str(e)[:500]}
    outcome["seconds_after_kill"] = time.monotonic() - killed["at"] if "at" in killed else None
    return outcome


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    print("RESULT " + json.dumps(run_vllm(spec)), flush=True)
