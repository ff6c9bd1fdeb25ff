"""A Mixture-of-Experts model's decode step against the dense model with the same active parameters (issue 40).

    python packages/runner/benchmarks/moe_step.py --json OUT [--repeats 3] [--experts 2 4 16] [--tiny]

The models (``moe_models``): a Qwen3-MoE checkpoint of random weights made by transformers (default: hidden 512,
8 layers, 8 experts of width 1024, top 2; 123M parameters, 48M active), and the Qwen3 model with the same hidden
size, layers and heads and a dense FFN of top_k x 1024 = 2048. Each model's decode step (``decode_bench.DecodeSteps``:
``decode_floor.DecodeBench``'s step, 128 tokens cached per request, sampling included, pp1 tp1, the runner's
defaults) is built in a fresh process of its own; the steps are timed in rounds, each process in turn (the order
rotating from round to round, so that the machine's load falls on all alike), at batch 64 and 1; the ratio
MoE / dense is taken per round. Goal: <= 1.5x.

What bounds the ratio, measured two ways in the same run:

- *the MLPs alone* (everything else in the two steps is the same: attention, norms, LM head, sampling): every
  layer's MLP applied once to a [batch, hidden] activation, one jit over per-layer arrays as the unrolled decode
  step reads them, timed alternately in one process: the runner's MoE MLP (``moe.moe_mlp``) both ways a stage runs
  it (with the CPU dense kernel, the routed-experts kernel over each expert's panels; with XLA's dots, every token
  through every expert, or the chosen experts gathered at a few tokens), the dense model's MLP (``model.mlp``) of
  the active width top_k x Fm on the CPU dense kernel over panels and on XLA's dot, and ``model.mlp`` of width
  num_experts x Fm both ways (every expert's FLOPs as one plain MLP; this / the active MLP is the FLOP ratio
  num_experts / top_k);
- *the step as the number of experts varies at fixed top_k* (``--experts``: more MoE checkpoints, the same
  widths; their processes join the rounds): a formulation that runs every expert grows by one expert's work per
  expert, where routed work would stay flat.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("PIPEJAX_CPU_KERNEL_BUILD", "wait")  # one formulation throughout: the kernels built first

from bench_support import EngineProcess, summary  # noqa: E402  (this folder's; run as a script)
from decode_bench import DecodeSteps  # noqa: E402
from machine_floor import timed  # noqa: E402
from moe_models import MoeSizes, make_checkpoint  # noqa: E402

GOAL = 1.5
HEADLINE_BATCH = 64


class MlpParts:
    """Every layer's MLP alone, four ways, for a process of its own (see the module docstring): ``seconds(name,
    rows, repeats)`` for name in ``NAMES``."""

    NAMES = ("moe_routed_kernel", "moe_xla", "dense_active_kernel", "dense_active_xla", "dense_all_experts_kernel",
             "dense_all_experts_xla")

    def __init__(self, sizes: MoeSizes):
        import jax
        import jax.numpy as jnp

        from pipejax.runner.config import MoeConfig
        from pipejax.runner.cpu import dense as cpu_dense
        from pipejax.runner.model import NO_KERNELS, Kernels, mlp
        from pipejax.runner.moe import moe_mlp, moe_param_shapes
        from pipejax.runner.panels import Panels, panel_shape

        E, X, k, Fm = sizes.hidden, sizes.experts, sizes.top_k, sizes.expert_width
        self.hidden = E
        moe = MoeConfig(num_experts=X, top_k=k, intermediate_size=Fm, norm_topk_prob=True)
        keys = iter(jax.random.split(jax.random.key(0), 16 * sizes.layers))

        def weight(shape, scale=0.02):
            return jax.random.normal(next(keys), shape, jnp.float32) * scale

        def dense_mlp(width: int, panels: bool) -> dict[str, Any]:
            shapes = {"gate_up": (E, 2, width), "down": (width, E)}  # random: in panels, only the shape matters
            if panels:  # as a CPU stage stores them: [*out[:-1], out[-1] / PANEL, in, PANEL]
                return {n: Panels(weight(panel_shape(shape, 0, 1))) for n, shape in shapes.items()}
            return {n: weight(shape) for n, shape in shapes.items()}

        def moe_layer(panels: bool) -> dict[str, Any]:
            shapes = moe_param_shapes(E, moe)
            p = {name: weight(shape, 1.0 if name == "router" else 0.02) for name, (shape, _) in shapes.items()}
            if panels:  # each expert's own panels, as a CPU stage with the dense kernel stores them
                p["experts_gate_up"] = Panels(weight(panel_shape(shapes["experts_gate_up"][0], 0, 1)))
                p["experts_down"] = Panels(weight(panel_shape(shapes["experts_down"][0], 1, 1)))
            return p

        L = sizes.layers
        layers = {
            "moe_routed_kernel": [moe_layer(panels=True) for _ in range(L)],
            "moe_xla": [moe_layer(panels=False) for _ in range(L)],
            "dense_active_kernel": [dense_mlp(k * Fm, panels=True) for _ in range(L)],
            "dense_active_xla": [dense_mlp(k * Fm, panels=False) for _ in range(L)],
            "dense_all_experts_kernel": [dense_mlp(X * Fm, panels=True) for _ in range(L)],
            "dense_all_experts_xla": [dense_mlp(X * Fm, panels=False) for _ in range(L)],
        }
        self.kernel = cpu_dense.prepare()
        kernels = Kernels(dense=cpu_dense.matmul, routed_experts=cpu_dense.routed_experts) if self.kernel else None

        def forward(name):
            chosen = kernels if name.endswith("_kernel") and kernels else NO_KERNELS

            def run(x, ps):
                for p in ps:
                    x = moe_mlp(x, p, moe, x, kernels=chosen) if name.startswith("moe") else mlp(x, p, x, chosen)
                return x

            return jax.jit(run)

        self._runs = {name: (forward(name), ps) for name, ps in layers.items()}

    def seconds(self, name: str, rows: int, repeats: int) -> float:
        """Median seconds of one application (compiled and warmed up before timing)."""
        import jax
        import jax.numpy as jnp

        run, ps = self._runs[name]
        # distinct rows, so that the router spreads them over the experts as a real batch's tokens (rows all alike
        # would all take the same top_k experts)
        x = jax.random.normal(jax.random.key(rows), (rows, self.hidden), jnp.float32)
        return statistics.median(timed(lambda: jax.block_until_ready(run(x, ps)), repeats))

    def kernel_available(self) -> bool:
        return self.kernel is not None


def checkpoints(root: Path, sizes: MoeSizes, experts: list[int]) -> dict[str, str]:
    """name -> checkpoint folder: "moe" (``sizes``), "dense" (its active twin), "moe_x{X}" for the other expert
    counts; each made once under ``root`` (a folder named by its sizes)."""
    out = {}
    wanted = [("moe", sizes, False), ("dense", sizes, True)]
    wanted += [(f"moe_x{x}", _with_experts(sizes, x), False) for x in experts if x != sizes.experts]
    for name, s, dense in wanted:
        folder = root / (("dense-" if dense else "moe-") + "-".join(str(v) for v in vars(s).values()))
        if not (folder / "config.json").exists():
            make_checkpoint(folder, s, dense=dense)
        out[name] = str(folder)
    return out


def _with_experts(sizes: MoeSizes, experts: int) -> MoeSizes:
    return dataclasses.replace(sizes, experts=experts)


def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = MoeSizes.tiny() if args.tiny else MoeSizes()
    steps = 3 if args.tiny else args.steps
    root = Path(args.checkpoints or tempfile.mkdtemp(prefix="pipejax-moe-"))
    try:
        return measure(args, sizes, checkpoints(root, sizes, args.experts), steps)
    finally:
        if not args.checkpoints:
            shutil.rmtree(root, ignore_errors=True)


def measure(args: argparse.Namespace, sizes: MoeSizes, paths: dict[str, str], steps: int) -> dict[str, Any]:
    batches = [HEADLINE_BATCH, 1]
    experts_of = {"moe": sizes.experts, "dense": None} | {n: int(n[5:]) for n in paths if n.startswith("moe_x")}
    times: dict[str, dict[int, list[float]]] = {n: {b: [] for b in batches} for n in paths}
    first_step_s, switches = {}, {}
    sides = {}
    try:
        for name, path in paths.items():  # built one after another: no compile runs beside another
            sides[name] = EngineProcess(DecodeSteps, path, batches)
            first_step_s[name], switches[name] = sides[name].call("first_steps"), sides[name].call("switches")
        names = list(paths)
        for r in range(args.repeats):
            order = names[r % len(names):] + names[:r % len(names)]  # rotate who goes first
            if r % 2:
                order.reverse()
            for name in order:
                for b in batches:
                    times[name][b].append(statistics.median(sides[name].call("seconds", b, steps)) * 1e3)
    finally:
        for side in sides.values():
            side.__exit__(None, None, None)
    with EngineProcess(MlpParts, sizes) as parts:
        mlp_ms: dict[str, dict[int, list[float]]] = {n: {b: [] for b in batches} for n in MlpParts.NAMES}
        for r in range(args.repeats):
            for name in MlpParts.NAMES if r % 2 == 0 else reversed(MlpParts.NAMES):
                for b in batches:
                    mlp_ms[name][b].append(parts.call("seconds", name, b, steps) * 1e3)
        kernel = parts.call("kernel_available")
    step = {n: {b: summary(v) for b, v in per_b.items()} for n, per_b in times.items()}
    ratio = {b: summary([m / d for m, d in zip(times["moe"][b], times["dense"][b], strict=True)]) for b in batches}
    mlp = {n: {b: summary(v) for b, v in per_b.items()} for n, per_b in mlp_ms.items()}
    as_runner = "kernel" if switches["dense"]["dense_matmuls"] == "cpu-kernel" else "xla"
    dense_choice, moe_choice = f"dense_active_{as_runner}", "moe_routed_kernel" if as_runner == "kernel" else "moe_xla"
    mlp_ratio = {b: summary([m / d for m, d in zip(mlp_ms[moe_choice][b], mlp_ms[dense_choice][b], strict=True)])
                 for b in batches}
    sweep = {experts_of[n]: step[n] for n in paths if n.startswith("moe")}
    return {
        "sizes": vars(sizes), "parameters": sizes.counts(), "checkpoints": paths, "batches": batches,
        "steps_per_call": steps, "rounds": args.repeats, "goal": GOAL,
        "switches": switches, "first_step_s": first_step_s, "step_ms": step, "moe_over_dense": ratio,
        "mlp_ms": mlp, "mlp_moe_over_dense": mlp_ratio, "dense_mlp_as_runner": dense_choice,
        "moe_mlp_as_runner": moe_choice,
        "dense_kernel_built": kernel, "step_ms_by_experts": dict(sorted(sweep.items())),
        "flop_ratio_of_formulation": sizes.experts / sizes.top_k,
    }


def report(result: dict[str, Any]) -> str:
    """The figures as markdown tables."""
    def cell(s):
        return f"{s['median']:.1f} [{s['min']:.1f}-{s['max']:.1f}]"

    lines = ["| batch | MoE step ms | dense step ms | MoE / dense | goal |", "|---:|---:|---:|---:|---|"]
    for b in result["batches"]:
        r = result["moe_over_dense"][b]
        lines.append(f"| {b} | {cell(result['step_ms']['moe'][b])} | {cell(result['step_ms']['dense'][b])} | "
                     f"{r['median']:.2f}x [{r['min']:.2f}-{r['max']:.2f}] | <= {GOAL}x |")
    lines += ["", "| MLPs alone, ms | " + " | ".join(f"batch {b}" for b in result["batches"]) + " |",
              "|---|" + "---:|" * len(result["batches"])]
    for name, per_b in result["mlp_ms"].items():
        lines.append(f"| {name} | " + " | ".join(cell(per_b[b]) for b in result["batches"]) + " |")
    lines += ["", "| experts (top " + str(result["sizes"]["top_k"]) + ") | " +
              " | ".join(f"step ms, batch {b}" for b in result["batches"]) + " |",
              "|---:|" + "---:|" * len(result["batches"])]
    for x, per_b in result["step_ms_by_experts"].items():
        lines.append(f"| {x} | " + " | ".join(cell(per_b[b]) for b in result["batches"]) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="write the figures here")
    parser.add_argument("--repeats", type=int, default=3, help="rounds (median and min-max reported)")
    parser.add_argument("--steps", type=int, default=10, help="steps per process per round (their median counts)")
    parser.add_argument("--experts", type=int, nargs="*", default=[2, 4, 16],
                        help="more MoE checkpoints with these expert counts (same top_k and widths) in the rounds")
    parser.add_argument("--checkpoints", default=None,
                        help="make (or reuse) the checkpoints in this folder (default: a temporary one, removed after)")
    parser.add_argument("--tiny", action="store_true", help="tiny models: a smoke run")
    args = parser.parse_args()
    result = run(args)
    print(report(result))
    Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
