"""Load one stage's parameters from a Hugging Face safetensors checkpoint.

Only the tensors the stage owns are read (memory-mapped), one parameter at a time; each is
converted to the runner's layout and placed straight into its TP sharding, so no process ever
holds the full model.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh
from safetensors import safe_open

from pipejax.pp_utils import logical_sharding
from pipejax.runner.config import ModelConfig, StageConfig
from pipejax.runner.model import RULES, kv_heads_for_tp, param_specs

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A tensor is missing from the checkpoint or has the wrong shape."""


class SafetensorsIndex:
    """Name -> file for a single-file or sharded (``model.safetensors.index.json``) checkpoint."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        index_file = self.path / "model.safetensors.index.json"
        if index_file.is_file():
            weight_map = json.loads(index_file.read_text())["weight_map"]
            self.files = {name: self.path / f for name, f in weight_map.items()}
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(
                    f"no *.safetensors files in {str(self.path)!r}; pipejax loads Hugging Face safetensors "
                    f"checkpoints (convert .bin weights with transformers' save_pretrained)"
                )
            self.files = {}
            for file in files:
                with safe_open(file, framework="numpy") as f:
                    self.files.update({name: file for name in f.keys()})
        self._stack = ExitStack()
        self._open: dict[Path, object] = {}

    def __enter__(self) -> SafetensorsIndex:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def read(self, name: str, expected_shape: tuple[int, ...]) -> np.ndarray:
        if name not in self.files:
            raise CheckpointError(
                f"tensor {name!r} (expected shape {list(expected_shape)}) is missing from the checkpoint in "
                f"{str(self.path)!r}; is config.json from the same model as the weights?"
            )
        file = self.files[name]
        if file not in self._open:
            self._open[file] = self._stack.enter_context(safe_open(file, framework="numpy"))
        handle = self._open[file]
        shape = tuple(handle.get_slice(name).get_shape())
        if shape != tuple(expected_shape):
            raise CheckpointError(
                f"tensor {name!r} in {file.name} has shape {list(shape)} but the config implies "
                f"{list(expected_shape)}; is config.json from the same model as the weights?"
            )
        return handle.get_tensor(name)


def _hf_layer_tensors(cfg: ModelConfig, tp: int) -> dict[str, tuple[str, tuple[int, ...], Callable]]:
    """Runner param name -> (HF name template, HF shape, HF array -> runner layout)."""
    E, F, H, D, K0 = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.head_dim, cfg.num_kv_heads
    repeat = kv_heads_for_tp(cfg, tp) // K0

    def heads_in(n: int, rep: int = 1):  # [n*D, E] -> [E, n*rep, D]
        return lambda w: np.repeat(w.T.reshape(E, n, D), rep, axis=1)

    def bias(n: int, rep: int = 1):  # [n*D] -> [n*rep, D]
        return lambda b: np.repeat(b.reshape(n, D), rep, axis=0)

    def same(w):
        return w

    def transpose(w):
        return w.T

    attn = "model.layers.{i}.self_attn."
    table = {
        "input_norm": ("model.layers.{i}.input_layernorm.weight", (E,), same),
        "q": (attn + "q_proj.weight", (H * D, E), heads_in(H)),
        "k": (attn + "k_proj.weight", (K0 * D, E), heads_in(K0, repeat)),
        "v": (attn + "v_proj.weight", (K0 * D, E), heads_in(K0, repeat)),
        "o": (attn + "o_proj.weight", (E, H * D), lambda w: w.T.reshape(H, D, E)),
        "post_norm": ("model.layers.{i}.post_attention_layernorm.weight", (E,), same),
        "gate": ("model.layers.{i}.mlp.gate_proj.weight", (F, E), transpose),
        "up": ("model.layers.{i}.mlp.up_proj.weight", (F, E), transpose),
        "down": ("model.layers.{i}.mlp.down_proj.weight", (E, F), transpose),
    }
    if cfg.qkv_bias:
        table["q_bias"] = (attn + "q_proj.bias", (H * D,), bias(H))
        table["k_bias"] = (attn + "k_proj.bias", (K0 * D,), bias(K0, repeat))
        table["v_bias"] = (attn + "v_proj.bias", (K0 * D,), bias(K0, repeat))
    if cfg.qk_norm:
        table["q_norm"] = (attn + "q_norm.weight", (D,), same)
        table["k_norm"] = (attn + "k_norm.weight", (D,), same)
    return table


def _host_params(
    ckpt: SafetensorsIndex, cfg: ModelConfig, stage: StageConfig, tp: int
) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (runner name, host array in runner layout), one parameter at a time."""
    layers = stage.layer_range(cfg)
    for name, (template, hf_shape, convert) in _hf_layer_tensors(cfg, tp).items():
        yield f"layers.{name}", np.stack([convert(ckpt.read(template.format(i=i), hf_shape)) for i in layers])
    V, E = cfg.vocab_size, cfg.hidden_size
    if stage.has_embedding(cfg):
        yield "embed", ckpt.read("model.embed_tokens.weight", (V, E))
    if stage.is_last:
        yield "final_norm", ckpt.read("model.norm.weight", (E,))
        if not cfg.tie_word_embeddings:
            yield "lm_head", ckpt.read("lm_head.weight", (V, E)).T


def load_stage_params(path: str | Path, cfg: ModelConfig, stage: StageConfig, mesh: Mesh) -> dict[str, jax.Array]:
    """The stage's parameters as arrays sharded on ``mesh`` (its "tp" axis)."""
    tp = mesh.shape["tp"]
    specs = param_specs(cfg, stage, tp)
    dtype = np.dtype(ml_dtypes.bfloat16) if cfg.dtype == "bfloat16" else np.dtype(cfg.dtype)
    params = {}
    with SafetensorsIndex(path) as ckpt:
        for name, host in _host_params(ckpt, cfg, stage, tp):
            spec = specs[name]
            assert host.shape == spec.shape, (name, host.shape, spec.shape)
            sharding = logical_sharding(mesh, spec.logical_axes, RULES)
            params[name] = jax.device_put(np.ascontiguousarray(host.astype(dtype, copy=False)), sharding)
            del host
    missing = set(specs) - set(params)
    assert not missing, missing
    log.info(
        "stage %d/%d loaded layers %s (%d tensors) from %s",
        stage.pp_rank,
        stage.pp_size,
        stage.layer_range(cfg),
        len(params),
        path,
    )
    return params
