"""Load one stage's parameters from a Hugging Face safetensors checkpoint.

Only the tensors the stage owns are read (memory-mapped), one parameter at a time; each is
converted to the runner's layout and placed straight into its TP sharding, so no process ever
holds the full model.
"""

from __future__ import annotations

import json
import logging
import mmap
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh

from pipejax.pp_utils import logical_sharding
from pipejax.runner.config import ModelConfig, StageConfig
from pipejax.runner.model import RULES, kv_heads_for_tp, param_specs

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A tensor is missing from the checkpoint or has the wrong shape."""


SAFETENSORS_DTYPES = {
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F64": np.dtype(np.float64),
}


class SafetensorsIndex:
    """Name -> tensor for a single-file or sharded (``model.safetensors.index.json``) checkpoint.

    Tensors are zero-copy views into memory-mapped files (the safetensors layout: an 8-byte
    header length, a JSON header with dtype/shape/offsets, then the raw data). ``release`` hands a
    tensor's pages back to the OS once it has been copied to the device, so a loading process
    never holds more than the tensor it is working on besides its own parameters.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        index_file = self.path / "model.safetensors.index.json"
        if index_file.is_file():
            files = sorted({self.path / f for f in json.loads(index_file.read_text())["weight_map"].values()})
        else:
            files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(
                f"no *.safetensors files in {str(self.path)!r}; pipejax loads Hugging Face safetensors "
                f"checkpoints (convert .bin weights with transformers' save_pretrained)"
            )
        self._maps: list[mmap.mmap] = []
        self.entries: dict[str, tuple[mmap.mmap, str, dict]] = {}
        for file in files:
            with open(file, "rb") as f:
                header_len = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(header_len))
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._maps.append(mapped)
            header.pop("__metadata__", None)
            for name, meta in header.items():
                meta["data_start"] = 8 + header_len + meta["data_offsets"][0]
                self.entries[name] = (mapped, file.name, meta)

    def __enter__(self) -> SafetensorsIndex:
        return self

    def __exit__(self, *exc) -> None:
        for mapped in self._maps:
            try:
                mapped.close()
            except BufferError:  # a caller still holds a view; the map closes when that view is freed
                pass
        self._maps.clear()

    def read(self, name: str, expected_shape: tuple[int, ...]) -> np.ndarray:
        """A read-only view of ``name``, checked against ``expected_shape``."""
        if name not in self.entries:
            raise CheckpointError(
                f"tensor {name!r} (expected shape {list(expected_shape)}) is missing from the checkpoint in "
                f"{str(self.path)!r}; is config.json from the same model as the weights?"
            )
        mapped, file_name, meta = self.entries[name]
        shape = tuple(meta["shape"])
        if shape != tuple(expected_shape):
            raise CheckpointError(
                f"tensor {name!r} in {file_name} has shape {list(shape)} but the config implies "
                f"{list(expected_shape)}; is config.json from the same model as the weights?"
            )
        if meta["dtype"] not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"tensor {name!r} has dtype {meta['dtype']}; supported: {sorted(SAFETENSORS_DTYPES)}")
        dtype = SAFETENSORS_DTYPES[meta["dtype"]]
        count = int(np.prod(shape)) if shape else 1
        return np.frombuffer(mapped, dtype, count, meta["data_start"]).reshape(shape)

    def release(self, name: str) -> None:
        """Drop the pages of ``name`` from this process (they stay in the OS page cache)."""
        mapped, _, meta = self.entries[name]
        start = meta["data_start"] // mmap.PAGESIZE * mmap.PAGESIZE
        end = meta["data_start"] + meta["data_offsets"][1] - meta["data_offsets"][0]
        mapped.madvise(mmap.MADV_DONTNEED, start, max(0, end - start))


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
    ckpt: SafetensorsIndex, cfg: ModelConfig, stage: StageConfig, tp: int, dtype: np.dtype
) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (runner name, host array in runner layout), one parameter at a time, largest first.

    Yielded arrays may be views into the mapped files; the caller copies them to the device
    before asking for the next one (their pages are released then).
    """
    V, E = cfg.vocab_size, cfg.hidden_size
    if stage.has_embedding(cfg):
        yield "embed", ckpt.read("model.embed_tokens.weight", (V, E))
        ckpt.release("model.embed_tokens.weight")
    if stage.is_last and not cfg.tie_word_embeddings:
        yield "lm_head", ckpt.read("lm_head.weight", (V, E)).T
        ckpt.release("lm_head.weight")
    layers = stage.layer_range(cfg)
    for name, (template, hf_shape, convert) in _hf_layer_tensors(cfg, tp).items():
        stacked = None
        for i, layer in enumerate(layers):
            hf_name = template.format(i=layer)
            converted = convert(ckpt.read(hf_name, hf_shape))
            if stacked is None:
                stacked = np.empty((len(layers), *converted.shape), dtype)
            stacked[i] = converted
            ckpt.release(hf_name)
        yield f"layers.{name}", stacked
    if stage.is_last:
        yield "final_norm", np.array(ckpt.read("model.norm.weight", (E,)))


def load_stage_params(path: str | Path, cfg: ModelConfig, stage: StageConfig, mesh: Mesh) -> dict[str, jax.Array]:
    """The stage's parameters as arrays sharded on ``mesh`` (its "tp" axis)."""
    tp = mesh.shape["tp"]
    specs = param_specs(cfg, stage, tp)
    dtype = np.dtype(ml_dtypes.bfloat16) if cfg.dtype == "bfloat16" else np.dtype(cfg.dtype)
    params = {}
    with SafetensorsIndex(path) as ckpt:
        for name, host in _host_params(ckpt, cfg, stage, tp, dtype):
            spec = specs[name]
            assert host.shape == spec.shape, (name, host.shape, spec.shape)
            sharding = logical_sharding(mesh, spec.logical_axes, RULES)
            params[name] = jax.device_put(host.astype(dtype, copy=False), sharding)
            params[name].block_until_ready()  # the host copy (or mapped pages) can go now
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
