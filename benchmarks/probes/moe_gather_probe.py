"""When gathering each token's routed experts beats running every expert (``runner.moe.GATHER_SHARE``): the
runner's two formulations of a Mixture-of-Experts layer's experts, timed alone on one XLA:CPU device, alternating,
at 1-32 tokens, for three expert counts. The weights are arguments (as in a stage), each result checked first.

    python benchmarks/probes/moe_gather_probe.py [--repeats 40]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from pipejax.runner.config import MoeConfig  # noqa: E402
from pipejax.runner.moe import experts, gathered_experts, route, top_experts  # noqa: E402

HIDDEN = 576
TOKENS = (1, 2, 4, 8, 16, 32)
SHAPES = ((64, 4, 256), (128, 8, 128), (16, 2, 384))  # (experts, top k, expert width)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args()
    for X, k, F in SHAPES:
        moe = MoeConfig(num_experts=X, top_k=k, intermediate_size=F, norm_topk_prob=True)
        rng = np.random.default_rng(0)
        weights = (rng.standard_normal((HIDDEN, X, 2, F), np.float32) * 0.05,
                   rng.standard_normal((X, F, HIDDEN), np.float32) * 0.05,
                   rng.standard_normal((HIDDEN, X), np.float32))
        gu, down, router = (jax.device_put(w) for w in weights)
        dense = jax.jit(lambda x, gu, down, router, moe=moe: experts(x, gu, down, route(x, router, moe)))
        gathered = jax.jit(lambda x, gu, down, router, moe=moe: gathered_experts(x, gu, down,
                                                                                 *top_experts(x, router, moe)))
        for T in TOKENS:
            x = jax.device_put(rng.standard_normal((T, HIDDEN), np.float32))
            np.testing.assert_allclose(dense(x, gu, down, router), gathered(x, gu, down, router), rtol=1e-4,
                                       atol=1e-4)
            times = {"dense": [], "gathered": []}
            for _ in range(args.repeats):
                for name, f in (("dense", dense), ("gathered", gathered)):
                    start = time.perf_counter()
                    f(x, gu, down, router).block_until_ready()
                    times[name].append(time.perf_counter() - start)
            d, g = (1e3 * statistics.median(times[n]) for n in ("dense", "gathered"))
            print(f"experts {X} top {k} width {F}, {T} tokens (routes / experts {T * k / X:.3f}): "
                  f"every expert {d:.2f} ms, gathered {g:.2f} ms: gathering {d / g:.2f}x", flush=True)


if __name__ == "__main__":
    main()
