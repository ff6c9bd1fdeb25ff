"""`pipejax generate` as a user runs it: a fresh process, simulated devices set up by the CLI itself."""

import os
import subprocess
import sys

import pytest


def run_cli(*args: str, env_extra: dict | None = None, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    # The CLI sets the device count itself; other XLA flags (the test sessions' -O0) stay.
    if other := [f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]:
        env["XLA_FLAGS"] = " ".join(other)
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "pipejax.ray_executor.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def test_generate_shows_text_placement_and_speed():
    proc = run_cli(
        "generate", "--model", "builtin", "-tp", "2", "--max-tokens", "6", "--seed", "3", "Hello, pipejax!", "2nd one",
        "--max-num-seqs", "2", "--max-num-batched-tokens", "32",  # fewer buckets for the warm-up to compile
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "stage 0: layers 0-1 on cpu:0, cpu:1" in out
    assert "stage 1: layers 2-3 on cpu:2, cpu:3" in out
    assert out.count("output: ") == 2 and "prompt: 'Hello, pipejax!'" in out
    assert "12 tokens in" in out and "tokens/s" in out
    # the warm-up compiled the run's own step shapes (each prompt's prefill in a batch of its own, the two
    # stages each with one in flight, then their decode steps), and the run compiled none
    assert "compiled during the run" not in out, out
    # one line says where the start-up went
    startup = [line for line in out.splitlines() if line.startswith("start-up ")]
    assert len(startup) == 1 and ", weights " in startup[0] and ", warm-up " in startup[0], out
    programs = int(startup[0].split(" XLA programs")[0].rsplit(" ", 1)[1])
    assert programs >= 2 * 3, startup  # 2 stages x (2 prefill shapes + 1 decode), the sampler's on top
    # one line says how the KV cache was sized: generate bounds max_model_len to what its prompts need
    kv = [line for line in out.splitlines() if "KV cache" in line]
    assert len(kv) == 1 and kv[0].startswith("KV cache: 5 blocks x 16 tokens (80 tokens), "), out
    assert kv[0].endswith("what 2 sequences x 32 tokens need; CPU budget 4 GiB shared by 2 stages on this host "
                          "(--cpu-kvcache-space / PIPEJAX_CPU_KVCACHE_SPACE)")


def test_generate_keeps_the_default_models_quantization():
    """The README's command for weights kept quantized, as written: the default model's Q4_1 file."""
    proc = run_cli("generate", "--quantization", "gguf", "--max-tokens", "8", "The capital of France is")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout.split("output: ", 1)[1], proc.stdout


def test_generate_sizes_its_run_by_its_prompts():
    """Where the user gave no --max-num-seqs / --max-model-len / --max-num-batched-tokens, generate's limits
    are its prompts'."""
    from pipejax.ray_executor.cli import generate_limits
    from pipejax.ray_executor.config import EngineConfig, ModelSource

    config = EngineConfig(ModelSource("m"))
    prompts = [{"prompt_token_ids": [1] * 5}, {"prompt_token_ids": [1] * 40}]
    sized = generate_limits(config, prompts, 24, False, False).scheduler
    assert (sized.max_num_seqs, sized.max_model_len) == (2, 64)  # 40 + 24, rounded up to a power of two
    assert sized.max_num_batched_tokens == 64  # 5 + 40 prompt tokens, rounded up the same way
    assert generate_limits(config, prompts, 25, True, True, True).scheduler == config.scheduler
    many = [{"prompt_token_ids": [1] * 300}] * 3  # more than the default budget: the default stays
    assert generate_limits(config, many, 8, False, False).scheduler.max_num_batched_tokens == 512
    short = generate_limits(config, [{"prompt_token_ids": [1] * 3}], 8, False, False).scheduler
    assert short.max_num_batched_tokens == 16
    assert generate_limits(config, ["no tokenizer"], 8, False, False).scheduler.max_model_len is None


def test_generate_warms_up_the_shapes_of_its_own_run():
    """generate's warm-up: each in-flight batch's prompts prefilled in one step, then its decode steps at every
    context bucket the run reaches; the engine's warm-up of every bucket where a prompt's length is unknown."""
    from pipejax.ray_executor.cli import generate_limits, generate_warmup_batches
    from pipejax.ray_executor.config import EngineConfig, ModelSource
    from pipejax.runner.inputs import Buckets

    prompts = [{"prompt_token_ids": [1] * n} for n in (5, 40, 7)]
    config = generate_limits(EngineConfig(ModelSource("m")), prompts, 30, False, False)  # max_model_len 128
    limits = config.scheduler
    buckets = Buckets.make(limits.max_num_batched_tokens, limits.max_num_seqs, limits.max_model_len, 16)

    def shapes(depth: int) -> list[tuple]:
        batches = generate_warmup_batches(prompts, 30, config, depth)
        return [tuple(buckets.shape_of(b, 16))[:5] for b in batches]  # (T, P, Q, Rd, B)

    assert buckets.rows == (1, 2, 3) and buckets.blocks == (4, 6, 8)
    # one batch in flight: all three prompts in one step of 52 tokens (padded to 64, its rows to 3), then 3
    # decode rows whose longest context grows from 41 to 69 tokens: 4 blocks, then 6
    assert shapes(1) == [(64, 3, 64, 0, 4), (3, 0, 1, 3, 4), (3, 0, 1, 3, 6)]
    # two in flight (pp=2): the first two prompts (45 tokens), decoded in 2 rows; the third alone (7 tokens,
    # its query padded to 8), decoded in 1 row within 4 blocks
    assert shapes(2) == [(64, 3, 64, 0, 4), (2, 0, 1, 2, 4), (2, 0, 1, 2, 6), (16, 3, 8, 0, 4), (1, 0, 1, 1, 4)]
    # a long run: the decode contexts of its first 128 tokens (at most 40 + 128 positions: up to 12 blocks) are
    # warmed up, not every bucket up to max_model_len 2048's 128 blocks (a run may stop at its first end-of-text)
    long = generate_limits(EngineConfig(ModelSource("m")), prompts, 2000, False, False)
    assert long.scheduler.max_model_len == 2048
    wide = Buckets.make(64, 3, 2048, 16)
    assert [tuple(wide.shape_of(b, 16))[3:5] for b in generate_warmup_batches(prompts, 2000, long, 1)] == [
        (0, 4), (3, 4), (3, 6), (3, 8), (3, 12)]  # (decode rows, blocks): the prefill, then 4 decode contexts
    assert generate_warmup_batches(["no tokenizer"], 30, config, 1) is None
    assert generate_warmup_batches(prompts * 30, 30, config, 1) is None  # more tokens than one step takes


def test_bench_throughput_compares_with_transformers_at_the_same_batch():
    from pipejax.ray_executor.bench import hf_batch_size
    from pipejax.ray_executor.cli import build_parser
    from pipejax.ray_executor.engine_args import engine_config_from_args

    args = build_parser().parse_args(["bench", "throughput"])
    limits = engine_config_from_args(args).scheduler
    assert args.hf_batch_size is None and hf_batch_size(limits.max_num_seqs, args.num_prompts) == 64
    assert limits.max_num_batched_tokens == 2048  # the command's own default
    args = build_parser().parse_args(["bench", "throughput", "--num-prompts", "8", "--max-num-seqs", "16"])
    assert hf_batch_size(engine_config_from_args(args).scheduler.max_num_seqs, args.num_prompts) == 8


def test_a_default_is_written_once_and_the_cli_and_engine_config_follow_it(monkeypatch):
    """Each engine setting's default lives in its config dataclass: change one there, and the CLI's help and
    ``engine_config`` (behind LLM, generate, serve) both follow."""
    import contextlib
    import dataclasses
    import io

    from pipejax.ray_executor.cli import build_parser
    from pipejax.ray_executor.engine_args import engine_config
    from pipejax.runner import config

    def help_line(flag):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--help"])
        text = " ".join(out.getvalue().split())
        return text[text.rindex(flag):][:300]  # its entry under options (the usage line comes first)

    assert "(default 16)" in help_line("--block-size") and engine_config("builtin").cache.block_size == 16
    assert "(default 512)" in help_line("--max-num-batched-tokens")

    @dataclasses.dataclass(frozen=True)
    class Changed(config.CacheConfig):
        block_size: int = 32

    @dataclasses.dataclass(frozen=True)
    class ChangedLimits(config.SchedulerConfig):
        max_num_batched_tokens: int = 1024

    monkeypatch.setattr(config, "CacheConfig", Changed)
    monkeypatch.setattr(config, "SchedulerConfig", ChangedLimits)
    assert "(default 32)" in help_line("--block-size")
    assert "(default 1024)" in help_line("--max-num-batched-tokens")
    built = engine_config("builtin")
    assert (built.cache.block_size, built.scheduler.max_num_batched_tokens) == (32, 1024)
    assert engine_config("builtin", block_size=8).cache.block_size == 8  # given: the flag wins


def test_the_offline_llm_takes_a_larger_step_budget_than_the_server_unless_told():
    """vLLM's usage contexts: ``LLM(model)`` prefills in steps of 2048 tokens, ``serve`` and ``generate`` (whose
    ``engine_config`` the CLI builds) in the server's 512; a budget given wins either way."""
    from pipejax.ray_executor.engine_args import engine_config
    from pipejax.ray_executor.llm import offline_engine_config

    def budget(config):
        return config.scheduler.max_num_batched_tokens

    assert budget(offline_engine_config("builtin")) == 2048
    assert budget(engine_config("builtin")) == 512
    assert budget(offline_engine_config("builtin", max_num_batched_tokens=512)) == 512
    assert budget(offline_engine_config("builtin", max_num_batched_tokens=None, max_num_seqs=8)) == 2048


def test_kv_flags_reach_the_cache_config(monkeypatch):
    """--cpu-kvcache-space and PIPEJAX_CPU_KVCACHE_SPACE (the flag wins) and --gpu-memory-utilization, None
    unless given (the CPU budget then applies; the 0.5 default is resolved where the memory is measured)."""
    from pipejax.ray_executor.cli import build_parser
    from pipejax.ray_executor.engine_args import engine_config, engine_config_from_args, env_keywords
    from pipejax.runner.config import CPU_KVCACHE_SPACE_ENV, CacheConfig

    assert env_keywords()["cpu_kvcache_space"] == CPU_KVCACHE_SPACE_ENV
    monkeypatch.delenv(CPU_KVCACHE_SPACE_ENV, raising=False)
    assert engine_config("builtin").cache == CacheConfig()
    monkeypatch.setenv(CPU_KVCACHE_SPACE_ENV, "2.5")
    assert engine_config("builtin").cache.cpu_kvcache_space == 2.5
    args = build_parser().parse_args(["serve", "--model", "builtin", "--cpu-kvcache-space", "1",
                                      "--gpu-memory-utilization", "0.3"])
    cache = engine_config_from_args(args).cache
    assert (cache.cpu_kvcache_space, cache.memory_fraction, cache.num_blocks) == (1.0, 0.3, None)
    monkeypatch.setenv(CPU_KVCACHE_SPACE_ENV, "lots")
    with pytest.raises(ValueError, match="PIPEJAX_CPU_KVCACHE_SPACE='lots' is not a number of GiB"):
        engine_config("builtin")


def test_generate_layout_too_large_is_one_clear_line():
    proc = run_cli(
        "generate",
        "--model",
        "builtin",
        "-pp",
        "4",
        "-tp",
        "2",
        "hi",
        env_extra={"XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 2
    assert "pipejax: error: pipeline_parallel_size=4 x tensor_parallel_size=2" in proc.stderr
    assert "fits: pipeline_parallel_size <= 2" in proc.stderr
    assert "devices in this process: cpu:0, cpu:1, cpu:2, cpu:3" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_generate_unknown_model_path(tmp_path):
    proc = run_cli("generate", "--model", str(tmp_path / "missing"), "hi")
    assert proc.returncode == 2
    assert f"model '{tmp_path / 'missing'}' is not a folder holding a Hugging Face checkpoint" in proc.stderr


def test_generate_on_a_tpu_host_uses_the_tpu_not_the_cpu():
    """A faked v5e-8 host (the TPU VM's TPU_ACCELERATOR_TYPE): the CLI gives the engine its chips and JAX the
    TPU backend, which this machine (no libtpu) cannot open. It must say so, not compute on the CPU."""
    proc = run_cli("generate", "--model", "builtin", "-pp", "2", "-tp", "2", "--max-tokens", "2", "hi",
                   env_extra={"TPU_ACCELERATOR_TYPE": "v5litepod-8"}, timeout=120)
    assert proc.returncode != 0 and "tokens/s" not in proc.stdout, proc.stdout
    assert "Unable to initialize backend 'tpu'" in proc.stderr, proc.stderr[-3000:]


def test_one_mapping_reads_the_partition_env_at_the_edge(monkeypatch):
    """``engine_config`` (behind LLM, generate and serve) reads PIPEJAX_PP_LAYER_PARTITION; an explicit
    partition wins; the flags and LLM's keywords are the same names."""
    from pipejax.ray_executor.cli import build_parser
    from pipejax.ray_executor.engine_args import ENGINE_ARGS, engine_config, engine_config_from_args

    monkeypatch.setenv("PIPEJAX_PP_LAYER_PARTITION", "1,3")
    assert engine_config("builtin", pipeline_parallel_size=2).parallel.pp_layer_partition == "1,3"
    explicit = engine_config("builtin", pipeline_parallel_size=2, pp_layer_partition="2,2")
    assert explicit.parallel.pp_layer_partition == "2,2"
    args = build_parser().parse_args(["generate", "--model", "builtin", "--max-num-seqs", "7", "hi"])
    config = engine_config_from_args(args)
    assert config == engine_config("builtin", pipeline_parallel_size=2, max_num_seqs=7)
    assert {"max_num_seqs", "gpu_memory_utilization", "pp_layer_partition"} <= set(vars(args)) & set(ENGINE_ARGS)


def test_the_cpu_kernel_build_setting_reaches_the_stages(monkeypatch):
    """Engines build CPU kernels numba lacks in the background by default; PIPEJAX_CPU_KERNEL_BUILD or the keyword
    (the CLI's --cpu-kernel-build) choose otherwise, and a bad value names itself and the choices."""
    from pipejax.ray_executor.engine_args import engine_config, env_keywords
    from pipejax.runner.cpu.select import KERNEL_BUILD_ENV

    assert env_keywords()["cpu_kernel_build"] == KERNEL_BUILD_ENV
    monkeypatch.delenv(KERNEL_BUILD_ENV, raising=False)
    assert engine_config("builtin").worker_config(1).cpu_kernel_build == "background"
    monkeypatch.setenv(KERNEL_BUILD_ENV, "wait")
    assert engine_config("builtin").worker_config(0).cpu_kernel_build == "wait"
    assert engine_config("builtin", cpu_kernel_build="cached").cpu_kernel_build == "cached"
    with pytest.raises(ValueError, match="cpu_kernel_build='later'.*--cpu-kernel-build.*background, wait, cached"):
        engine_config("builtin", cpu_kernel_build="later")


def test_the_cpu_dense_tiles_setting_reaches_the_stages(monkeypatch):
    """The dense kernel's tiles are measured ("auto") unless PIPEJAX_CPU_DENSE_TILES or the keyword (the CLI's
    --cpu-dense-tiles: "amx" keeps no AMX tiles beside the weights) say otherwise; a bad value names the choices."""
    from pipejax.ray_executor.engine_args import engine_config, env_keywords
    from pipejax.runner.cpu.select import DENSE_TILES_ENV

    assert env_keywords()["cpu_dense_tiles"] == DENSE_TILES_ENV
    monkeypatch.delenv(DENSE_TILES_ENV, raising=False)
    assert engine_config("builtin").worker_config(1).cpu_dense_tiles == "auto"
    monkeypatch.setenv(DENSE_TILES_ENV, "amx")
    assert engine_config("builtin").worker_config(0).cpu_dense_tiles == "amx"
    assert engine_config("builtin", cpu_dense_tiles="vector").worker_config(0).cpu_dense_tiles == "vector"
    with pytest.raises(ValueError, match="cpu_dense_tiles='tf32'.*--cpu-dense-tiles.*auto, vector, amx, amx-kept"):
        engine_config("builtin", cpu_dense_tiles="tf32")


def test_the_environment_is_read_at_the_edge_only(monkeypatch, tmp_path):
    """Every variable the engine honours becomes a config field in ``engine_config`` (an explicit keyword
    wins); below it nothing reads the environment, so a config built directly takes the defaults."""
    from pipejax.ray_executor.config import CPU_DEVICE_RESOURCE, EngineConfig, ModelSource, RayConfig
    from pipejax.ray_executor.engine_args import ENGINE_ARGS, engine_config, env_keywords
    from pipejax.runner.builtin_model import CACHE_DIR_ENV
    from pipejax.worker.worker import CACHE_DIR_ENV as COMPILATION_CACHE_DIR_ENV
    from pipejax.worker.worker import default_compilation_cache_dir

    names = env_keywords()
    assert set(names) <= set(ENGINE_ARGS)
    assert names["model_cache_dir"] == CACHE_DIR_ENV
    assert names["compilation_cache_dir"] == COMPILATION_CACHE_DIR_ENV
    models = os.environ["PIPEJAX_CACHE_DIR"]  # this run's (conftest)
    env = {"RAY_ADDRESS": "10.0.0.1:6379", "PIPEJAX_RAY_DEVICE_RESOURCE": "my_cpu",
           "PIPEJAX_PLATFORM_PLUGIN": "tpu", "PIPEJAX_COMPILATION_CACHE_DIR": str(tmp_path)}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    config = engine_config("builtin")
    assert config.model.path.startswith(models)
    assert (config.ray.address, config.ray.device_resource) == ("10.0.0.1:6379", "my_cpu")
    assert config.platform_plugin == "tpu" and config.compilation_cache_dir == str(tmp_path)
    assert config.worker_config(0).compilation_cache_dir == str(tmp_path)
    explicit = engine_config("builtin", ray_address="auto", ray_device_resource="dev", platform_plugin="x",
                             compilation_cache_dir="/c", model_cache_dir=str(tmp_path / "models"))
    assert (explicit.ray.address, explicit.ray.device_resource, explicit.platform_plugin) == ("auto", "dev", "x")
    assert explicit.compilation_cache_dir == "/c" and explicit.model.path.startswith(str(tmp_path / "models"))
    monkeypatch.setenv("PIPEJAX_COMPILATION_CACHE_DIR", "")  # set but empty: no cache, as documented
    assert engine_config("builtin").compilation_cache_dir is None
    for key in env:
        monkeypatch.delenv(key)
    unset = engine_config("builtin")
    assert (unset.ray.address, unset.ray.device_resource, unset.platform_plugin) == (None, CPU_DEVICE_RESOURCE, None)
    assert unset.compilation_cache_dir == default_compilation_cache_dir()
    direct = EngineConfig(ModelSource(unset.model.path))
    assert direct.ray == RayConfig() and direct.compilation_cache_dir == default_compilation_cache_dir()
