"""The torchax model implementation: load a stage's weights into TP shardings, run the stage.

``TORCHAX_IMPL`` is what the ``pipejax.model_impls`` entry point ``torchax`` names. Its two
functions have exactly the native ones' signatures (``pipejax.runner.checkpoint.load_stage_params``
and ``pipejax.runner.model.stage_forward``), so the runner's jitted step, paged KV cache, padding
buckets, scheduler and sampler work unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import torch
import torchax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from torchax.interop import jax_view, torch_view
from transformers import AutoConfig

from pipejax.pp_utils import logical_sharding
from pipejax.runner import gguf_file
from pipejax.runner.checkpoint import open_checkpoint
from pipejax.runner.config import ModelConfig, StageConfig
from pipejax.runner.model import RULES
from pipejax.runner.model_impl import ModelImpl
from pipejax.runner.step_inputs import StepInputs, StepShape
from pipejax.torchax_bridge.attention import PagedKV
from pipejax.torchax_bridge.stage_model import build_stage_module, stage_hf_config, stage_param_specs

log = logging.getLogger(__name__)

# torchax's default environment enters shared torch-mode objects; stages that trace in different
# threads of one process (the in-process executor) take turns. Only tracing holds it, not steps.
_TRACE_LOCK = threading.Lock()


@functools.partial(jax.tree_util.register_dataclass, data_fields=["weights"], meta_fields=["module"])
@dataclasses.dataclass(frozen=True, eq=False)
class TorchStageParams:
    """A stage's parameters: its weights and buffers as (sharded) JAX arrays, keyed by their names
    in ``module``, and the weightless meta-device module they are swapped into (static under jit)."""

    weights: dict[str, jax.Array]
    module: torch.nn.Module


def _hf_config(path: str | Path):
    """transformers' config of a checkpoint folder, or of a GGUF file (built from its metadata)."""
    gguf = gguf_file.find_gguf(path)
    if gguf is None:
        return AutoConfig.from_pretrained(path)
    hf = gguf_file.hf_config(gguf_file.open_reader(gguf), gguf)
    return AutoConfig.for_model(hf.pop("model_type"), **hf)


def load_stage_params(path: str | Path, cfg: ModelConfig, stage: StageConfig, mesh: Mesh) -> TorchStageParams:
    """Build the stage's module and read only its tensors, each straight into its TP sharding."""
    tp = mesh.shape["tp"]
    config = stage_hf_config(_hf_config(path), cfg, stage)
    module = build_stage_module(config, cfg, stage)
    specs = stage_param_specs(module, cfg, stage, tp)
    dtype = np.dtype(ml_dtypes.bfloat16) if cfg.dtype == "bfloat16" else np.dtype(cfg.dtype)
    weights: dict[str, jax.Array] = {}
    by_checkpoint_name: dict[str, jax.Array] = {}  # a tied embedding is read once on a pp=1 stage
    with open_checkpoint(path) as ckpt:  # safetensors, or a GGUF file dequantized into HF layout
        for name, spec in specs.items():
            if spec.checkpoint_name not in by_checkpoint_name:
                host = ckpt.read_all(spec.checkpoint_name, spec.shape)
                sharding = logical_sharding(mesh, spec.logical_axes, RULES)
                array = jax.device_put(np.ascontiguousarray(host.astype(dtype, copy=False)), sharding)
                by_checkpoint_name[spec.checkpoint_name] = array
                del host
            weights[name] = by_checkpoint_name[spec.checkpoint_name]
    replicated = NamedSharding(mesh, PartitionSpec())
    for name, buffer in module.named_buffers():
        assert buffer.device.type == "cpu", (name, buffer.device)  # computed buffers (rotary), never meta
        weights[name] = jax.device_put(buffer.numpy(), replicated)
    log.info(
        "stage %d/%d (torchax) loaded layers %s (%d tensors) from %s",
        stage.pp_rank,
        stage.pp_size,
        stage.layer_range(cfg),
        len(specs),
        path,
    )
    return TorchStageParams(weights, module)


def stage_forward(
    params: TorchStageParams,
    kv_cache: tuple[jax.Array, jax.Array],  # ([L, N, block_size, K, D], same)
    inp: StepInputs,
    hidden_in: jax.Array | None,  # [T, E] from the previous stage; None on the first stage
    *,
    cfg: ModelConfig,
    stage: StageConfig,
    shape: StepShape,
    block_size: int,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """Run the stage's transformers module on JAX values (traced under the runner's jit).

    Returns (hidden [T, E] on non-last stages | logits [R, V] f32 on the last, updated cache). The
    ragged step is one batch row of T tokens; paging keeps the requests apart in attention.
    """
    paged = PagedKV(kv_cache, inp, shape, block_size)
    kwargs = {"position_ids": inp.positions[None], "use_cache": False, "paged_kv": paged}  # [1, T]
    if stage.is_first:
        kwargs["input_ids"] = inp.token_ids[None]  # [1, T]
    else:
        kwargs["inputs_embeds"] = hidden_in[None]  # [1, T, E]
    if stage.is_last:
        kwargs["logits_to_keep"] = inp.sample_index  # [R]: the LM head runs on these rows only
    with _TRACE_LOCK, torchax.default_env(), torch.no_grad():
        out = torch.func.functional_call(params.module, torch_view(params.weights), (), torch_view(kwargs))
    if stage.is_last:
        return jax_view(out.logits)[0].astype(jnp.float32), paged.kv_cache  # [R, V]
    return jax_view(out.last_hidden_state)[0], paged.kv_cache  # [T, E]


TORCHAX_IMPL = ModelImpl("torchax", load_stage_params, stage_forward)
