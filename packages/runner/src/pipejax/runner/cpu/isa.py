"""What numba compiles the CPU kernels for: numba's own target (``NUMBA_CPU_NAME`` / ``NUMBA_CPU_FEATURES`` where
set, else the host's CPU as LLVM sees it), so that a kernel's register tile matches the code LLVM emits for it: the
vector width, and whether it has AMX's bf16 tiles."""

from __future__ import annotations

import functools

# numba CPU names (LLVM's) whose targets have AVX-512; any other named target is taken as at most AVX2
_AVX512_CPUS = ("skylake-avx512", "cascadelake", "cooperlake", "cannonlake", "icelake-client", "icelake-server",
                "tigerlake", "rocketlake", "sapphirerapids", "graniterapids", "emeraldrapids", "znver4", "znver5",
                "knl", "knm", "x86-64-v4")


def _features() -> list[str] | None:
    """numba's target features (``+avx512f``, ...), or None where only a CPU name is set."""
    import llvmlite.binding as llvm
    from numba.core import config

    features = config.CPU_FEATURES
    if not features and config.CPU_NAME in (None, "", "host"):
        features = llvm.get_host_cpu_features().flatten()
    return features.split(",") if features else None


@functools.cache
def vector_lanes() -> int:
    """float32 lanes of the widest vector register numba's target has: 16 with AVX-512F, else 8 (AVX2; SSE and
    NEON targets get 8 too, which LLVM splits into their 4-lane registers)."""
    from numba.core import config

    features = _features()
    if features:
        return 16 if "+avx512f" in features else 8
    return 16 if config.CPU_NAME in _AVX512_CPUS else 8


@functools.cache
def last_level_cache_bytes(root: str = "/sys/devices/system/cpu/cpu0/cache", default: int = 16 << 20) -> int:
    """Bytes of the largest cache Linux lists for CPU 0 (``root/index*/size``: ``16384K``), or ``default`` where it
    lists none."""
    import glob

    units, sizes = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}, []
    for path in glob.glob(f"{root}/index*/size"):
        try:
            with open(path) as f:
                text = f.read().strip()
            sizes.append(int(text[:-1]) * units[text[-1]] if text[-1:] in units else int(text))
        except (OSError, ValueError):
            continue
    return max(sizes, default=default)


@functools.cache
def amx() -> bool:
    """Whether numba's target has AMX's tiles with bf16 products (``amx-tile`` and ``amx-bf16``; a target named
    without its features is taken as not)."""
    features = _features() or []
    return "+amx-tile" in features and "+amx-bf16" in features


@functools.cache
def grant_amx() -> bool:
    """Ask Linux for this process's AMX tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``, needed
    once per process before the first tile instruction); whether it is granted (False off x86-64 Linux)."""
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    arch_prctl, req_xcomp_perm, xtiledata = 158, 0x1023, 18
    return ctypes.CDLL(None, use_errno=True).syscall(arch_prctl, req_xcomp_perm, xtiledata) == 0
