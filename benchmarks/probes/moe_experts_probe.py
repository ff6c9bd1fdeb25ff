"""Formulations of a Mixture-of-Experts layer's experts on XLA:CPU against the runner's own (issue 40): which would
bring a MoE step nearer the dense model of the same active parameters. A probe, not wired in.

    python benchmarks/probes/moe_experts_probe.py [--rows 1 64 512] [--experts 8] [--repeats 3]

Every layer of the MoE benchmark's model (``moe_models.MoeSizes``: hidden 512, 8 layers, 8 experts of width 1024,
top 2), one jit over per-layer arrays (as the runner's unrolled decode step reads them), the routing included; each
formulation checked against the runner's within 1e-4 first, then timed in rounds, alternating:

- ``runner``: ``moe.moe_mlp`` as the stage runs it (every token through every expert; at T k <= X / 4 routes, each
  token's top k experts' weights gathered by XLA);
- ``dense_dot_general``: the runner's every-expert formulation with its down projection as ``lax.dot_general``
  over (X, Fm) in stored order (the runner's einsum has XLA:CPU copy down [X, Fm, E] to [Fm, X, E] every step);
- ``wide_kernel``: every expert as one wide MLP on the CPU dense kernel over panels ([E, 2, X Fm]: every expert's
  gate, then every up), the routing weights applied between its two matmuls: the dense formulation's FLOPs at the
  kernel's rate;
- ``chosen_kernel`` (rows <= 8): for each (token, expert) route, the kernel on that expert's panels read in place
  (the experts as the kernel's stacked "layers", the expert a dynamic index): no weight copied, T k experts read;
- ``capacity_kernel``: the routes sorted by expert into X slots of C = 2 T k / X rows (a multiple of 8), each
  expert's slots through the kernel on its panels in place: 2x the routed FLOPs; exact (``runner`` runs instead
  where an expert got more routes than C);
- ``ragged_dot``: the routes sorted by expert through ``jax.lax.ragged_dot``;
- references, not the MoE: ``active_xla`` / ``active_kernel``, the dense model's MLP of the active width top_k x Fm
  (``model.mlp``) on XLA's dot / the CPU dense kernel: the routed work at the dense model's rate.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
RUNNER_BENCHMARKS = Path(__file__).resolve().parents[2] / "packages" / "runner" / "benchmarks"
sys.path.insert(0, str(RUNNER_BENCHMARKS))  # the runner's benchmark helpers: the timer, the model's sizes

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from machine_floor import timed  # noqa: E402
from moe_models import MoeSizes  # noqa: E402

from pipejax.runner import model, panels  # noqa: E402
from pipejax.runner.config import MoeConfig  # noqa: E402
from pipejax.runner.cpu import dense as cpu_dense  # noqa: E402
from pipejax.runner.moe import moe_mlp, moe_param_shapes, top_experts  # noqa: E402
from pipejax.runner.panels import PANEL, swiglu  # noqa: E402

CHOSEN_MAX_ROWS = 8


def runner(x, p, moe: MoeConfig):
    return moe_mlp(x, p, moe, 0 * x)


def dense_dot_general(x, p, moe: MoeConfig):
    """``moe.experts`` (every token through every expert) with its down projection contracted by
    ``lax.dot_general`` over (X, Fm) in stored order: the runner's einsum "txf,xfe->te" contracts them as (f, x),
    and XLA:CPU copies down [X, Fm, E] into [Fm, X, E] before the dot, every step."""
    T = x.shape[0]
    top, chosen = top_experts(x, p["router"], moe)
    weights = jnp.zeros((T, moe.num_experts), jnp.float32).at[jnp.arange(T)[:, None], chosen].set(top)
    h = jnp.einsum("te,excf->txcf", x, p["experts_gate_up"])
    act = swiglu(h[:, :, 0], h[:, :, 1]) * weights[:, :, None]  # [T, X, Fm]
    return jax.lax.dot_general(act, p["experts_down"], (((1, 2), (0, 1)), ((), ())))


def wide_kernel(x, p, moe: MoeConfig):
    T = x.shape[0]
    top, chosen = top_experts(x, p["router"], moe)
    weights = jnp.zeros((T, moe.num_experts), jnp.float32).at[jnp.arange(T)[:, None], chosen].set(top)
    act = panels.dense(x, p["wide_gate_up"], 1, cpu_dense.matmul, gated=True)  # [T, X Fm]
    act = (act.reshape(T, moe.num_experts, -1) * weights[:, :, None]).reshape(T, -1)
    return panels.dense(act, p["wide_down"], 1, cpu_dense.matmul)


def chosen_kernel(x, p, moe: MoeConfig):
    top, chosen = top_experts(x, p["router"], moe)  # [T, k]
    y = jnp.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(moe.top_k):
            e = chosen[t, j]
            act = cpu_dense.matmul(x[t:t + 1], p["expert_gate_up"], e, gated=True) * top[t, j]  # [1, Fm]
            y = y.at[t].add(cpu_dense.matmul(act, p["expert_down"], e)[0])
    return y


def sorted_routes(x, p, moe: MoeConfig):
    """The routes sorted by expert: (top, chosen [T, k], the flat expert of each sorted route, the route order)."""
    top, chosen = top_experts(x, p["router"], moe)
    flat = chosen.reshape(-1)  # [T k]
    order = jnp.argsort(flat, stable=True)
    return top, flat, order


def capacity_kernel(x, p, moe: MoeConfig):
    T, E = x.shape
    X, k = moe.num_experts, moe.top_k
    C = -(-2 * T * k // X // 8) * 8
    top, flat, order = sorted_routes(x, p, moe)
    sizes = jnp.bincount(flat, length=X)
    expert = flat[order]
    slot = jnp.arange(T * k) - (jnp.cumsum(sizes) - sizes)[expert]  # each sorted route's row in its expert's slots

    def slotted(_):
        rows = jnp.full((X, C), T, jnp.int32).at[expert, slot].set(order // k, mode="drop")  # T: an empty row
        scale = jnp.zeros((X, C), x.dtype).at[expert, slot].set(top.reshape(-1)[order], mode="drop")
        padded = jnp.concatenate([x, jnp.zeros((1, E), x.dtype)])
        y = jnp.zeros((T + 1, E), x.dtype)
        for e in range(X):
            act = cpu_dense.matmul(padded[rows[e]], p["expert_gate_up"], e, gated=True) * scale[e][:, None]
            y = y.at[rows[e]].add(cpu_dense.matmul(act, p["expert_down"], e))
        return y[:T]

    return jax.lax.cond(jnp.max(sizes) <= C, slotted, lambda _: runner(x, p, moe), None)


def ragged_dot(x, p, moe: MoeConfig):
    E, X, Fm = x.shape[1], moe.num_experts, moe.intermediate_size
    top, flat, order = sorted_routes(x, p, moe)
    token = order // moe.top_k
    sizes = jnp.bincount(flat, length=X).astype(jnp.int32)
    gate_up = p["experts_gate_up"].transpose(1, 0, 2, 3).reshape(X, E, 2 * Fm)  # [X, E, 2 Fm] (a copy)
    h = jax.lax.ragged_dot(x[token], gate_up, sizes)
    act = swiglu(h[:, :Fm], h[:, Fm:]) * top.reshape(-1)[order][:, None]
    return jnp.zeros_like(x).at[token].add(jax.lax.ragged_dot(act, p["experts_down"], sizes))


def active_xla(x, p, moe: MoeConfig):
    return model.mlp(x, {"gate_up": p["gate_up"], "down": p["down"]}, 0 * x)


def active_kernel(x, p, moe: MoeConfig):
    return model.mlp(x, {"gate_up": p["active_gate_up"], "down": p["active_down"]}, 0 * x, cpu_dense.matmul)


FORMULATIONS = {"runner": runner, "dense_dot_general": dense_dot_general, "wide_kernel": wide_kernel,
                "chosen_kernel": chosen_kernel, "capacity_kernel": capacity_kernel, "ragged_dot": ragged_dot,
                "active_xla": active_xla, "active_kernel": active_kernel}
REFERENCES = ("active_xla", "active_kernel")  # not the MoE: not checked against it


def gate_up_panels(w):
    """[E, 2, F] -> the kernel's panels [2 F / PANEL, E, PANEL] (gate panels, then up)."""
    E, _, F = w.shape
    return w.reshape(E, 2 * F // PANEL, PANEL).transpose(1, 0, 2)


def down_panels(w):
    """[F, E] -> [E / PANEL, F, PANEL]."""
    F, E = w.shape
    return w.reshape(F, E // PANEL, PANEL).transpose(1, 0, 2)


def layer_weights(key, sizes: MoeSizes, moe: MoeConfig) -> dict:
    """One layer's MoE weights as the runner stores them (``moe_param_shapes``), the same in the kernel's panels
    (one wide MLP; per expert), and an active-width dense MLP's."""
    E, X, Fm, k = sizes.hidden, sizes.experts, sizes.expert_width, sizes.top_k
    keys = iter(jax.random.split(key, 8))
    p = {n: jax.random.normal(next(keys), s, jnp.float32) * (1.0 if n == "router" else 0.02)
         for n, (s, _) in moe_param_shapes(E, moe).items()}
    gate_up, down = p["experts_gate_up"], p["experts_down"]  # [E, X, 2, Fm], [X, Fm, E]
    wide = gate_up.transpose(0, 2, 1, 3).reshape(E, 2, X * Fm)
    p["wide_gate_up"] = panels.Panels(gate_up_panels(wide).reshape(2, X * Fm // PANEL, E, PANEL))
    p["wide_down"] = panels.Panels(down_panels(down.reshape(X * Fm, E)))
    p["expert_gate_up"] = jnp.stack([gate_up_panels(gate_up[:, e]) for e in range(X)])  # [X, 2 Fm / 32, E, 32]
    p["expert_down"] = jnp.stack([down_panels(down[e]) for e in range(X)])  # [X, E / 32, Fm, 32]
    p["gate_up"] = jax.random.normal(next(keys), (E, 2, k * Fm), jnp.float32) * 0.02
    p["down"] = jax.random.normal(next(keys), (k * Fm, E), jnp.float32) * 0.02
    p["active_gate_up"] = panels.Panels(gate_up_panels(p["gate_up"]).reshape(2, k * Fm // PANEL, E, PANEL))
    p["active_down"] = panels.Panels(down_panels(p["down"]))
    return p


def layers_fn(formulation):
    def run(x, layers, moe):
        for p in layers:
            x = x + formulation(x, p, moe)
        return x

    return jax.jit(run, static_argnums=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 512])
    parser.add_argument("--experts", type=int, default=None, help="default: the benchmark model's")
    parser.add_argument("--repeats", type=int, default=3, help="rounds")
    parser.add_argument("--steps", type=int, default=10, help="calls per formulation per round (median)")
    args = parser.parse_args()
    sizes = MoeSizes()
    if args.experts:
        sizes = dataclasses.replace(sizes, experts=args.experts)
    moe = MoeConfig(num_experts=sizes.experts, top_k=sizes.top_k, intermediate_size=sizes.expert_width,
                    norm_topk_prob=True)
    if not cpu_dense.prepare():
        raise SystemExit("the CPU dense kernel could not be built here (numba)")
    layers = [layer_weights(key, sizes, moe) for key in jax.random.split(jax.random.key(0), sizes.layers)]
    print(f"{os.cpu_count()} CPUs; {sizes.layers} layers, hidden {sizes.hidden}, {sizes.experts} experts of "
          f"{sizes.expert_width}, top {sizes.top_k}; ms: median of {args.steps} calls per round, median [min-max] "
          f"over {args.repeats} rounds")
    for rows in args.rows:
        x = jax.random.normal(jax.random.key(rows), (rows, sizes.hidden), jnp.float32)
        names = [n for n in FORMULATIONS if n != "chosen_kernel" or rows <= CHOSEN_MAX_ROWS]
        runs = {n: layers_fn(FORMULATIONS[n]) for n in names}
        want = np.asarray(runs["runner"](x, layers, moe))
        for n in names:
            if n not in REFERENCES:
                np.testing.assert_allclose(np.asarray(runs[n](x, layers, moe)), want, rtol=1e-4, atol=1e-4)
        ms: dict[str, list[float]] = {n: [] for n in names}
        for r in range(args.repeats):
            for n in names if r % 2 == 0 else names[::-1]:
                run, inputs = runs[n], (x, layers, moe)
                t = timed(lambda: run(*inputs).block_until_ready(), args.steps)  # noqa: B023 - called at once
                ms[n].append(statistics.median(t) * 1e3)
        print(f"rows {rows}: " + "; ".join(
            f"{n} {statistics.median(v):.2f} [{min(v):.2f}-{max(v):.2f}]" for n, v in ms.items()))


if __name__ == "__main__":
    main()
