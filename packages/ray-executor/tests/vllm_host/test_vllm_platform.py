"""pipejax's vLLM platform on its own: what vLLM resolves, and what it refuses (no engine started)."""

from __future__ import annotations

import os

import pytest
import vllm
import vllm.platforms
from oracle import TINY  # the ray-executor tests' tiny checkpoints
from vllm.engine.arg_utils import EngineArgs
from vllm.exceptions import VLLMValidationError

from pipejax.platform_tpu.vllm_platform import PipejaxPlatform
from pipejax.runner.builtin_model import write_checkpoint
from pipejax.worker.kv_sizing import cpu_kvcache_space_from_env
from pipejax.worker.vllm_requests import UnsupportedFeatureError, to_sampling_params


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    write_checkpoint(path, {**TINY, "architectures": ["LlamaForCausalLM"]}, seed=0)
    return str(path)


def test_vllm_resolves_pipejax_platform():
    assert isinstance(vllm.platforms.current_platform, PipejaxPlatform)


def test_config_hides_tp_inside_each_stage(checkpoint):
    config = EngineArgs(model=checkpoint, tensor_parallel_size=2, pipeline_parallel_size=3,
                        distributed_executor_backend="mp").create_engine_config()
    pc = config.parallel_config
    assert (pc.tensor_parallel_size, pc.pipeline_parallel_size, pc.world_size) == (1, 3, 3)  # a rank per stage
    opts = config.additional_config["pipejax"]
    assert opts["tensor_parallel_size"] == 2
    assert pc.worker_cls == "pipejax.worker.vllm_worker.VllmStageWorker"
    assert config.cache_config.block_size == 16
    assert config.scheduler_config.async_scheduling is False
    # Each stage process gets 2 simulated devices of its own, and keeps the driver's other XLA flags.
    others = [f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
    for env in opts["stage_environments"]:
        flags = env["XLA_FLAGS"].split()
        assert [f for f in flags if "host_platform_device_count" in f] == ["--xla_force_host_platform_device_count=2"]
        assert sorted(f for f in flags if "host_platform_device_count" not in f) == sorted(others)
    # The platform reads PIPEJAX_COMPILATION_CACHE_DIR (the conftest's) for the workers, which read no environment.
    assert opts["compilation_cache_dir"] == os.environ["PIPEJAX_COMPILATION_CACHE_DIR"]
    # and the CPU KV budget: vLLM's own variable where pipejax's is unset (None: the default budget)
    assert opts["cpu_kvcache_space"] == cpu_kvcache_space_from_env(os.environ)
    # and how the stages wait for CPU kernels numba has not built (the engines' default: in the background)
    assert opts["cpu_kernel_build"] == os.environ.get("PIPEJAX_CPU_KERNEL_BUILD", "background")
    assert opts["cpu_dense_tiles"] == os.environ.get("PIPEJAX_CPU_DENSE_TILES", "auto")


def test_the_cpu_kv_budget_comes_from_vllms_variable(checkpoint, monkeypatch):
    monkeypatch.delenv("PIPEJAX_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    config = EngineArgs(model=checkpoint, pipeline_parallel_size=2,
                        distributed_executor_backend="mp").create_engine_config()
    assert config.additional_config["pipejax"]["cpu_kvcache_space"] == 2.0


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"enable_lora": True}, "LoRA"),
    ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype"),
    ({"pipeline_parallel_size": 2, "distributed_executor_backend": "uni"}, "Pipeline Parallelism without"),  # vLLM's
    # pipejax's layout rule: 12 devices of one engine on a host of 8 simulated devices.
    ({"tensor_parallel_size": 4, "pipeline_parallel_size": 3, "distributed_executor_backend": "mp"}, "needs 2 hosts"),
])
def test_unsupported_engine_configs_are_refused_by_name(checkpoint, kwargs, named):
    with pytest.raises(Exception, match=named):
        EngineArgs(model=checkpoint, **kwargs).create_engine_config()


@pytest.mark.parametrize("kwargs", [{"prompt_logprob_token_ids": [[3]]}])
def test_unsupported_sampling_is_refused_by_name(kwargs):
    params = vllm.SamplingParams(**kwargs)
    name = next(iter(kwargs))
    with pytest.raises(VLLMValidationError, match=name):  # vLLM's 400, not an engine failure
        PipejaxPlatform.validate_request(None, params)
    with pytest.raises(UnsupportedFeatureError, match=name):
        to_sampling_params(params)


def test_supported_sampling_translates():
    ours = to_sampling_params(vllm.SamplingParams(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, seed=3,
                                                  logprobs=4))
    assert (ours.temperature, ours.top_p, ours.top_k, ours.min_p, ours.seed, ours.logprobs) == (
        0.7, 0.9, 20, 0.05, 3, 4)
    assert to_sampling_params(vllm.SamplingParams(logprobs=-1)).logprobs == -1  # the whole vocabulary
    assert to_sampling_params(vllm.SamplingParams(prompt_logprobs=2)).prompt_logprobs == 2
    greedy = to_sampling_params(vllm.SamplingParams(temperature=0, top_p=0.5, top_k=3))
    assert (greedy.temperature, greedy.top_p, greedy.top_k) == (0.0, 1.0, 0)
    shaped = vllm.SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2,
                                 min_tokens=3, logit_bias={5: 1.0}, allowed_token_ids=[5, 6, 9], stop_token_ids=[9])
    shaped._bad_words_token_ids = [[7], [8, 9]]  # what vLLM's input processor makes of bad_words=[...]
    ours = to_sampling_params(shaped)
    assert (ours.presence_penalty, ours.frequency_penalty, ours.repetition_penalty, ours.min_tokens) == (
        0.5, -0.5, 1.2, 3)
    assert ours.logit_bias == ((5, 1.0),) and ours.allowed_token_ids == (5, 6, 9) and 9 in ours.min_tokens_stop_ids
    assert ours.bad_words_token_ids == ((7,), (8, 9)) and ours.needs_history
    PipejaxPlatform.validate_request(None, vllm.SamplingParams(temperature=0.7, top_k=20, logprobs=4))
