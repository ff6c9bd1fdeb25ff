"""Frozen configs of the runner: the model (converted from Hugging Face at the edge), the stage,
the KV cache, and the batching limits."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from pipejax.pp_utils import PartCosts, balanced_partition, stage_layer_range

log = logging.getLogger(__name__)

AUTO_PARTITION = "auto"  # the --pp-layer-partition value that asks for a split balanced by cost

# --quantization (``quantized``): "gguf" keeps a GGUF file's Q8_0/Q4_0/Q4_1 tensors as stored; "int8" and "int4"
# quantize float weights as they load; None keeps float weights (a GGUF file's dequantized as they load).
QUANTIZATION_CHOICES = ("gguf", "int8", "int4")


def check_quantization(value: str | None) -> None:
    if value is not None and value not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization={value!r} is not one pipejax knows; use one of "
                         f"{', '.join(QUANTIZATION_CHOICES)}, or none for float weights")

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
)


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # "default" or "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


# Mixture-of-Experts architectures (``MoeConfig``; their layers' MLPs are ``runner.moe``), and the dense one each
# is otherwise (attention, norms, biases).
MOE_ARCHITECTURES = {"MixtralForCausalLM": "MistralForCausalLM", "Qwen2MoeForCausalLM": "Qwen2ForCausalLM",
                     "Qwen3MoeForCausalLM": "Qwen3ForCausalLM"}


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """A Mixture-of-Experts MLP, as transformers' Qwen3-MoE, Mixtral and Qwen2-MoE configure it."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's FFN width
    norm_topk_prob: bool  # renormalise the top-k routing weights to sum to 1 (Mixtral always)
    shared_expert_size: int = 0  # Qwen2-MoE: one shared expert of this width behind a sigmoid gate (0: none)
    sparse_step: int = 1  # layer i is sparse when (i + 1) % sparse_step == 0 ...
    dense_layers: tuple[int, ...] = ()  # ... and i is not one of these (mlp_only_layers); the others are dense

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers and (layer + 1) % self.sparse_step == 0

    @classmethod
    def from_hf(cls, arch: str, hf: dict) -> MoeConfig:
        """From a ``config.json`` (Qwen's ``num_experts``, which transformers 5 writes as ``num_local_experts``)."""
        mixtral = arch == "MixtralForCausalLM"
        return cls(
            num_experts=hf.get("num_experts") or hf["num_local_experts"],
            top_k=hf["num_experts_per_tok"],
            intermediate_size=hf["intermediate_size" if mixtral else "moe_intermediate_size"],
            norm_topk_prob=mixtral or bool(hf.get("norm_topk_prob", False)),
            shared_expert_size=int(hf.get("shared_expert_intermediate_size") or 0),
            sparse_step=int(hf.get("decoder_sparse_step") or 1),
            dense_layers=tuple(hf.get("mlp_only_layers") or ()),
        )


def check_expert_parallel(num_experts: int, tp: int) -> None:
    """Expert parallelism puts num_experts / tp whole experts on each of a stage's devices: refused where tp does
    not divide num_experts (checked by the engine before any stage starts, and by the stage's sharding rules)."""
    if num_experts % tp:
        raise ValueError(f"expert parallelism puts num_experts / tp whole experts on each device, but num_experts="
                         f"{num_experts} is not divisible by tensor_parallel_size={tp}; use a tp that divides "
                         f"{num_experts}, or turn expert parallelism off (each expert's FFN is then split over tp)")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig = RopeConfig()
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    moe: MoeConfig | None = None  # Mixture-of-Experts layers (None: every layer's MLP is dense)
    quantization: str | None = None  # weights kept quantized (``quantized.QUANTIZATION_CHOICES``); None: float

    @classmethod
    def from_hf(cls, hf: dict, dtype: str | None = None) -> ModelConfig:
        """Convert a Hugging Face ``config.json`` dict (transformers 4.x or 5.x field names)."""
        archs = hf.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or hf.get('model_type')!r}; pipejax's JAX runner supports "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        rope_src = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        kind = rope_src.get("rope_type", rope_src.get("type", "default")) or "default"
        if kind not in ("default", "llama3"):
            raise ValueError(f"unsupported rope_type {kind!r}; pipejax supports 'default' and 'llama3'")
        rope = RopeConfig(
            theta=float(rope_src.get("rope_theta", hf.get("rope_theta", 10000.0))),
            kind=kind,
            factor=float(rope_src.get("factor", 1.0)),
            low_freq_factor=float(rope_src.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope_src.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(rope_src.get("original_max_position_embeddings", 8192)),
        )
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        moe = MoeConfig.from_hf(arch, hf) if arch in MOE_ARCHITECTURES else None
        arch_of_attention = MOE_ARCHITECTURES.get(arch, arch)
        if arch_of_attention == "Qwen2ForCausalLM":
            window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
        elif arch_of_attention == "MistralForCausalLM":
            window = hf.get("sliding_window")
        else:
            window = None
        if (
            window is not None
            and arch_of_attention == "Qwen2ForCausalLM"
            and hf.get("max_window_layers", 0) < hf["num_hidden_layers"]
        ):
            raise ValueError("Qwen2 with sliding window on only some layers (max_window_layers) is not supported")
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf.get("intermediate_size") or 0,  # a MoE model's dense layers' (if any)
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            rope=rope,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=arch_of_attention == "Qwen2ForCausalLM" or bool(hf.get("attention_bias", False)),
            qk_norm=arch_of_attention == "Qwen3ForCausalLM",
            sliding_window=window,
            dtype=dtype or _hf_dtype(hf),
            bos_token_id=hf.get("bos_token_id"),
            moe=moe,
            eos_token_ids=eos_ids,
        )

    def part_costs(self) -> PartCosts:
        """What each part of a decode step costs, modelled from the model's shape (``--pp-layer-partition auto``).

        A decode step reads every weight of its stage once (for all its rows) and does ~2 FLOPs per weight per
        row, so both its memory traffic and its arithmetic grow with the parameters a part holds: a part's
        modelled time is its parameter count, and its memory those parameters' bytes. The first stage's embedding
        is a lookup (memory, no time); the last stage's final norm and LM head (the tied embedding, where tied)
        are a full matmul. Left out: attention's KV reads (they grow with the rows and their contexts, which a
        start does not know) and each layer's work beside its matmuls. Both weigh on the layers: on a 2-core EPYC
        SmolLM2-135M's even split at pp=2 kept its stages 0.69 and 0.89 busy (64 requests, 128 in, 64 out), so
        its LM head and sampler cost ~4 layers there where this model says ~8 (BENCHMARKS.md, "Stage split by
        cost"). A model, not a measurement."""
        h, heads, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        projections = h * heads + 2 * h * kv + heads * h  # q, k, v, o
        small = 2 * h + (heads + 2 * kv if self.qkv_bias else 0) + (2 * self.head_dim if self.qk_norm else 0)
        table, size, n = self.vocab_size * h, 2 if self.dtype == "bfloat16" else 4, self.num_layers
        moe, dense = self.moe, 3 * h * self.intermediate_size
        # a MoE layer reads every expert (a batch's tokens reach them all) but computes top_k of them per token
        work = [projections + small + (dense if moe is None or not moe.is_sparse(i) else
                                       h * moe.num_experts + 3 * h * (moe.top_k * moe.intermediate_size
                                                                      + moe.shared_expert_size))
                for i in range(n)]
        # what a stage holds: the dense projections (and the vocabulary's table) in their kept format
        # (``weight_bytes``); norms, biases and a MoE's router and experts in float
        quantized, vocabulary = (weight_bytes(self.quantization, size, v) for v in (False, True))
        held = [(projections + (dense if moe is None or not moe.is_sparse(i) else 0)) * quantized + size * (
                    small + (0 if moe is None or not moe.is_sparse(i) else
                             h * moe.num_experts + 3 * h * (moe.num_experts * moe.intermediate_size
                                                             + moe.shared_expert_size)))
                for i in range(n)]
        return PartCosts(layer_time=tuple(map(float, work)), layer_bytes=tuple(map(float, held)),
                         first_time=0.0, first_bytes=float(table * vocabulary),
                         last_time=float(table + h), last_bytes=float(table * vocabulary + h * size))

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: str | None = None, quantization: str | None = None
                        ) -> ModelConfig:
        """From a Hugging Face checkpoint folder, or a GGUF file (or a folder holding one). ``quantization``: keep
        the weights quantized (``quantized.QUANTIZATION_CHOICES``), refused where the checkpoint cannot be."""
        from pipejax.runner import gguf_file

        check_quantization(quantization)
        if (gguf := gguf_file.find_gguf(path)) is not None:
            reader = gguf_file.open_reader(gguf)
            gguf_file.check_quantization(reader, gguf, quantization)
            return dataclasses.replace(cls.from_hf(gguf_file.hf_config(reader, gguf), dtype=dtype),
                                       quantization=quantization)
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(
                f"no config.json in model path {str(path)!r}; give a folder holding a Hugging Face checkpoint "
                f"(config.json + *.safetensors) or a .gguf file, or 'builtin' for the built-in model"
            )
        hf = json.loads(config_file.read_text())
        if quantization == "gguf":
            raise ValueError(f"quantization='gguf' keeps a GGUF file's quantized tensors, but {str(path)!r} is a "
                             f"safetensors checkpoint; give a .gguf file, or use --quantization int8 or int4")
        if quantization is not None and hf.get("quantization_config"):
            method = hf["quantization_config"].get("quant_method", "?")
            raise ValueError(f"{str(path)!r} is already quantized ({method}, its config.json's quantization_config); "
                             f"--quantization {quantization} quantizes float weights: drop it, or give the float "
                             f"checkpoint")
        return dataclasses.replace(cls.from_hf(hf, dtype=dtype), quantization=quantization)


def weight_bytes(quantization: str | None, float_size: int, vocabulary: bool) -> float:
    """Bytes a stage holds per weight of a dense projection (``vocabulary``: of the embedding or LM head) kept as
    ``quantization`` makes it (``quantized.ON_THE_FLY``, ``ON_THE_FLY_VOCABULARY``). "gguf" and float:
    ``float_size`` (a GGUF file's formats are not in its config: modelled as float, an overestimate)."""
    from pipejax.runner.quantized import ON_THE_FLY, ON_THE_FLY_VOCABULARY  # jax: not at this module's import

    fmt = (ON_THE_FLY_VOCABULARY if vocabulary else ON_THE_FLY).get(quantization)
    return float(float_size) if fmt is None else fmt.bytes_per_weight


def _hf_dtype(hf: dict) -> str:
    name = str(hf.get("dtype") or hf.get("torch_dtype") or "float32").replace("torch.", "")
    if name not in ("float32", "bfloat16"):
        return "float32" if name == "float16" else name
    return name


def auto_partition(model: ModelConfig, pp: int) -> tuple[int, ...]:
    """The layer counts per stage that balance the modelled stage costs (``ModelConfig.part_costs``)."""
    costs = model.part_costs()
    counts = balanced_partition(costs, pp)
    start, times = 0, []
    for rank, count in enumerate(counts):
        times.append(costs.stage_time(start, start + count, pp, rank) / 1e6)
        start += count
    log.info("pp layer partition auto: %s (modelled from the weights each stage reads per step: %s M parameters)",
             ",".join(map(str, counts)), ", ".join(f"{t:.1f}" for t in times))
    return counts


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Which model a stage serves and how to load it (its architecture comes from the checkpoint)."""

    path: str  # a folder holding a Hugging Face checkpoint, or a GGUF file (the edges resolve a name to it)
    dtype: str | None = None  # None: the checkpoint's
    quantization: str | None = None  # keep the weights quantized (``ModelConfig.quantization``); None: float
    seed: int = 0
    impl: str = "jax"  # or a name registered in the pipejax.model_impls entry-point group

    def model_config(self) -> ModelConfig:
        """The model's config as this source loads it (its dtype, its quantization)."""
        if self.quantization is not None and self.impl != "jax":
            raise ValueError(f"quantization={self.quantization!r} keeps weights quantized in pipejax's JAX model, not "
                             f"in model_impl={self.impl!r}; use model_impl='jax', or leave quantization out")
        return ModelConfig.from_pretrained(self.path, dtype=self.dtype, quantization=self.quantization)


@dataclasses.dataclass(frozen=True)
class StageConfig:
    """Which part of the model this stage runs."""

    pp_rank: int = 0
    pp_size: int = 1
    partition: tuple[int, ...] | str | None = None  # None: the even rule; "auto": balanced by modelled cost
    expert_parallel: bool = False  # MoE layers: whole experts per tp device, else each expert's FFN split over tp

    @property
    def is_first(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def layer_range(self, model: ModelConfig) -> range:
        partition = self.partition
        if partition == AUTO_PARTITION:  # balanced by modelled cost; every stage computes the same split
            partition = auto_partition(model, self.pp_size)
        return stage_layer_range(model.num_layers, self.pp_rank, self.pp_size, partition)

    def has_embedding(self, model: ModelConfig) -> bool:
        return self.is_first or (self.is_last and model.tie_word_embeddings)


DEFAULT_MEMORY_FRACTION = 0.5  # of an accelerator's free memory, where no fraction is given
DEFAULT_CPU_KVCACHE_SPACE_GIB = 4.0  # vLLM's CPU backend's long-standing VLLM_CPU_KVCACHE_SPACE default
CPU_AVAILABLE_RAM_SHARE = 0.5  # the default CPU budget never exceeds this share of the host's available RAM
CPU_KVCACHE_SPACE_ENV = "PIPEJAX_CPU_KVCACHE_SPACE"  # read at the edges (engine_args.environment_defaults)


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache of one stage (the same on every stage), and how its size is chosen
    (``pipejax.worker.kv_sizing`` does the arithmetic):

    - ``num_blocks`` given: that many blocks.
    - An accelerator (its devices report ``bytes_limit``): what ``max_num_seqs x max_model_len`` need, at
      most ``memory_fraction`` (None: ``DEFAULT_MEMORY_FRACTION``) of each device's free memory.
    - CPU (simulated devices share host RAM): what ``max_num_seqs x max_model_len`` need, at most this
      stage's share of a per-host budget of ``cpu_kvcache_space`` GiB (None: ``DEFAULT_CPU_KVCACHE_SPACE_GIB``,
      never more than ``CPU_AVAILABLE_RAM_SHARE`` of the host's available RAM) that every stage of the
      ``engines_on_host`` engines on the host shares; a ``memory_fraction`` given explicitly replaces the
      budget with that fraction of the host's available RAM.
    """

    block_size: int = 16
    num_blocks: int | None = None  # None: sized from memory, as above
    memory_fraction: float | None = None  # None: the budget on CPU, DEFAULT_MEMORY_FRACTION on accelerators
    cpu_kvcache_space: float | None = None  # GiB per host on CPU; None: the default budget
    engines_on_host: int = 1  # data-parallel engines whose stages share this host's budget

    def __post_init__(self):
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size} must be a power of two, e.g. 16")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks={self.num_blocks} must be >= 2 (block 0 is reserved for padding)")
        if self.memory_fraction is not None and not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction={self.memory_fraction} must be in (0, 1], e.g. 0.5")
        if self.cpu_kvcache_space is not None and not self.cpu_kvcache_space > 0:
            raise ValueError(
                f"cpu_kvcache_space={self.cpu_kvcache_space} GiB must be > 0, e.g. 4 "
                f"(--cpu-kvcache-space / {CPU_KVCACHE_SPACE_ENV})"
            )
        if self.engines_on_host < 1:
            raise ValueError(f"engines_on_host={self.engines_on_host} must be >= 1")


# The offline ``LLM``'s step budget where none is given (``SchedulerConfig``'s 512 is the server's), as vLLM gives
# its ``LLM`` class a larger one than its server: a batch's prompts prefill in fewer, larger steps, and no
# stream waits through them (BENCHMARKS.md has the throughput it buys on CPU).
OFFLINE_MAX_NUM_BATCHED_TOKENS = 2048


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Batching limits: the engine's scheduler keeps every batch within them, and each stage's runner
    sizes its padding buckets (and its KV cache's useful size) by them."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # None: the model's max_position_embeddings (``for_model`` resolves it)

    def __post_init__(self):
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_seqs={self.max_num_seqs} and max_num_batched_tokens={self.max_num_batched_tokens} "
                "must be >= 1"
            )

    def for_model(self, model: ModelConfig) -> SchedulerConfig:
        """These limits with ``max_model_len`` resolved against ``model`` (never past its
        ``max_position_embeddings``). The engine resolves it once and hands it down; a worker or runner
        used on its own resolves what it is given (a no-op for a resolved config)."""
        limit = model.max_position_embeddings
        return dataclasses.replace(self, max_model_len=min(self.max_model_len or limit, limit))
