"""The vector width numba compiles the CPU kernels for: numba's own target (``NUMBA_CPU_NAME`` /
``NUMBA_CPU_FEATURES`` where set, else the host's CPU as LLVM sees it), so that a kernel's register tile matches
the code LLVM emits for it."""

from __future__ import annotations

import functools

# numba CPU names (LLVM's) whose targets have AVX-512; any other named target is taken as at most AVX2
_AVX512_CPUS = ("skylake-avx512", "cascadelake", "cooperlake", "cannonlake", "icelake-client", "icelake-server",
                "tigerlake", "rocketlake", "sapphirerapids", "graniterapids", "emeraldrapids", "znver4", "znver5",
                "knl", "knm", "x86-64-v4")


@functools.cache
def vector_lanes() -> int:
    """float32 lanes of the widest vector register numba's target has: 16 with AVX-512F, else 8 (AVX2; SSE and
    NEON targets get 8 too, which LLVM splits into their 4-lane registers)."""
    import llvmlite.binding as llvm
    from numba.core import config

    features = config.CPU_FEATURES
    if not features and config.CPU_NAME in (None, "", "host"):
        features = llvm.get_host_cpu_features().flatten()
    if features:
        return 16 if "+avx512f" in features.split(",") else 8
    return 16 if config.CPU_NAME in _AVX512_CPUS else 8
