"""The benchmark model's dense matmuls alone (every weight matrix once, one jit), in XLA (over [in, out] weights or
the CPU dense kernel's panels, as a loop over layers or a scan), in torch and in numpy: the decode floor's
cross-checks of the 64-row matmul rate (``decode_floor.py``) and the throughput section's parts floor."""

from __future__ import annotations

import statistics

from machine_floor import timed  # this folder's (run as a script, or put on the path)


def dense_shapes(cfg) -> list[tuple[int, int]]:
    """One layer's weight matrices as the runner stores them: q/k/v as one, o, gate/up as one, down."""
    E, F, H, K, D = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    return [(E, (H + 2 * K) * D), (H * D, E), (E, 2 * F), (F, E)]


class DenseMatmuls:
    """Every weight matrix of the model (random, resident; q/k/v and gate/up fused as the runner holds them) and
    one jit applying them all to an activation: the dots a step must run, timed alone. ``rows`` go through the
    layers, the first ``head_rows`` of them through the LM head (a decode step samples every row, a prefill step
    only each prompt's last token). ``panels``: the weights in panels (``panels.Panels``), multiplied by the CPU
    dense kernel (``cpu_dense``), as a CPU stage's decode steps run them; else XLA's dot on [in, out] weights."""

    def __init__(self, cfg, panels: bool = False):
        import jax
        import jax.numpy as jnp

        from pipejax.runner.cpu import dense as cpu_dense
        from pipejax.runner.model import PANEL

        E, F, H, K, D, V, L = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                               cfg.head_dim, cfg.vocab_size, cfg.num_layers)
        key = jax.random.key(0)

        def weight(shape):
            w = jax.random.normal(key, shape, jnp.float32) * 0.02
            return w.reshape(shape[0], -1, PANEL).transpose(1, 0, 2) if panels else w

        self.layers = [[weight(s) for s in dense_shapes(cfg)] for _ in range(L)]
        self.head = weight((E, V))
        self.width = E
        mm = (lambda x, w: cpu_dense.matmul(x, w[None])) if panels else jnp.matmul  # [None]: a stack of one layer

        def layer(x, weights):
            qkv, o, gate_up, down = weights
            h = mm(x, qkv)
            a = h[:, :H * D] + jnp.pad(h[:, H * D:(H + K) * D] + h[:, (H + K) * D:], ((0, 0), (0, (H - K) * D)))
            x = x + mm(a, o)
            h = mm(x, gate_up)
            return x + mm(jax.nn.silu(h[:, :F]) * h[:, F:], down)

        def looped(x, layers, head, head_rows):
            for weights in layers:
                x = layer(x, weights)
            return mm(x[:head_rows], head)

        def scanned(x, stacked, head, head_rows):
            return mm(jax.lax.scan(lambda x, w: (layer(x, w), None), x, stacked)[0][:head_rows], head)

        self._looped = jax.jit(looped, static_argnums=3)
        self._scanned = jax.jit(scanned, static_argnums=3)

    def seconds(self, rows: int, head_rows: int, repeats: int, scan: bool = False) -> float:
        """Median seconds of one application (compiled and warmed up before timing)."""
        import jax
        import jax.numpy as jnp

        x = jnp.ones((rows, self.width), jnp.float32)
        if scan:
            stacked = [jnp.stack(ws) for ws in zip(*self.layers, strict=True)]
            run = lambda: self._scanned(x, stacked, self.head, head_rows)  # noqa: E731
        else:
            run = lambda: self._looped(x, self.layers, self.head, head_rows)  # noqa: E731
        return statistics.median(timed(lambda: jax.block_until_ready(run()), repeats))


def _twin_widths(cfg) -> tuple[int, int, int, int]:
    """What ``DenseMatmuls``' twins in other libraries need to split the fused outputs: the hidden width, the query
    and the key (= value) widths of the q/k/v output, and the MLP's width."""
    return cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size


class TorchDenseMatmuls:
    """``DenseMatmuls``' matrices and order in torch (random, resident, fp32, torch's default threads), for a process
    of its own (``EngineProcess``): a second library's matmuls at the decode step's row count, so that the gap
    between a 64-row matmul and the 2048³ rate is measured as the machine's, not only XLA:CPU's."""

    def __init__(self, cfg):
        import torch

        gen = torch.Generator().manual_seed(0)
        self.layers = [[torch.randn(s, generator=gen) * 0.02 for s in dense_shapes(cfg)] for _ in range(cfg.num_layers)]
        self.head = torch.randn((cfg.hidden_size, cfg.vocab_size), generator=gen) * 0.02
        self.width, self.q, self.kv, self.F = _twin_widths(cfg)

    def seconds(self, rows: int, head_rows: int, repeats: int) -> float:
        """Median seconds of one application (warmed up before timing)."""
        import torch

        x = torch.ones(rows, self.width)

        @torch.inference_mode()
        def run():
            h = x
            q, kv, F = self.q, self.kv, self.F
            for qkv, o, gate_up, down in self.layers:
                a = h @ qkv
                a = a[:, :q] + torch.nn.functional.pad(a[:, q:q + kv] + a[:, q + kv:], (0, q - kv))
                h = h + a @ o
                g = h @ gate_up
                h = h + (torch.nn.functional.silu(g[:, :F]) * g[:, F:]) @ down
            return h[:head_rows] @ self.head

        return statistics.median(timed(run, repeats))


class NumpyDenseMatmuls:
    """``DenseMatmuls``' matrices and order in numpy (its BLAS: OpenBLAS in numpy's wheels; random, resident, fp32,
    every output written into a buffer allocated once, so no page faults are timed), for a process of its own: a
    third library's matmuls at the decode step's row count."""

    def __init__(self, cfg):
        import numpy as np

        rng = np.random.default_rng(0)
        self.layers = [[rng.standard_normal(s, np.float32) * np.float32(0.02) for s in dense_shapes(cfg)]
                       for _ in range(cfg.num_layers)]
        self.head = rng.standard_normal((cfg.hidden_size, cfg.vocab_size), np.float32) * np.float32(0.02)
        self.width, self.q, self.kv, self.F = _twin_widths(cfg)

    def seconds(self, rows: int, head_rows: int, repeats: int) -> float:
        """Median seconds of one application (warmed up before timing)."""
        import numpy as np

        q, kv, F = self.q, self.kv, self.F
        qkv, o, gate_up, down = self.layers[0]
        x, a, g = (np.ones((rows, self.width), np.float32), np.empty((rows, qkv.shape[1]), np.float32),
                   np.empty((rows, gate_up.shape[1]), np.float32))
        h, attn, act = np.empty_like(x), np.empty((rows, q), np.float32), np.empty((rows, F), np.float32)
        logits = np.empty((head_rows, self.head.shape[1]), np.float32)

        def run():
            x.fill(1.0)  # the same input every time (a residual stream growing over repeats could reach denormals)
            for qkv, o, gate_up, down in self.layers:
                np.matmul(x, qkv, out=a)
                attn[:] = a[:, :q]
                attn[:, :kv] += a[:, q:q + kv] + a[:, q + kv:]
                np.matmul(attn, o, out=h)
                np.add(x, h, out=x)
                np.matmul(x, gate_up, out=g)
                np.multiply(g[:, :F] / (1 + np.exp(-g[:, :F])), g[:, F:], out=act)
                np.matmul(act, down, out=h)
                np.add(x, h, out=x)
            np.matmul(x[:head_rows], self.head, out=logits)

        return statistics.median(timed(run, repeats))


def dense_matmuls(cfg, batch: int, repeats: int, scan: bool = False, panels: bool = False) -> float:
    """Seconds for every weight matrix of the model applied once to a [batch, E] activation (one jit): a loop
    over per-layer arrays, or (``scan``) a ``lax.scan`` over the layers' stacked weights, as the runner's layer
    loop reads them (XLA:CPU copies each layer's slice before its dots read it); ``panels``: see DenseMatmuls."""
    return DenseMatmuls(cfg, panels).seconds(batch, batch, repeats, scan)
