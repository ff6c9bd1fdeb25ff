"""``cpu.select``: each CPU kernel runs where it measured faster than XLA's formulation on this host, the verdict
is remembered per host signature and shapes, and an explicit choice still forces one."""

import dataclasses
import json

import jax
import pytest

from pipejax.pp_utils import stage_mesh
from pipejax.runner.config import ModelConfig, SchedulerConfig
from pipejax.runner.cpu import select as sel

CFG = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=64, intermediate_size=128,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-6,
                  max_position_embeddings=64)
LIMITS = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32).for_model(CFG)
FLAGS = "processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu sse4_2 avx avx2 fma {extra}\n"


def _figures(kernel: float, xla: float) -> dict:
    return {"kernel": kernel, "xla": xla}


def test_verdict_takes_the_kernel_only_where_it_is_faster():
    assert sel.verdict({"decode": _figures(1, 2), "prefill": _figures(3, 4)}) == "cpu-kernel"
    assert sel.verdict({"decode": _figures(2.1, 2), "prefill": _figures(3, 4)}) == "xla"
    assert sel.verdict({"decode": _figures(1, 2), "prefill": _figures(4.1, 4)}) == "cpu-kernel"  # within 5%
    assert sel.verdict({"decode": _figures(1, 2), "prefill": _figures(5, 4)}) == "xla"
    assert sel.verdict({"prefill": _figures(4.3, 4)}) == "xla"


def test_a_dense_kernel_faster_only_at_the_decode_rows_leaves_larger_calls_to_xla_over_its_panels(monkeypatch):
    """Where XLA's dot over the panels is within 5% of XLA's own at the prefill rows and beats the kernel there by
    more, the kernel runs the decode rows only (an AVX2 EPYC: XLA's dot is slow at 64 rows, not at 512)."""
    def figures(decode, prefill):
        return {"decode": dict(zip(("kernel", "xla"), decode, strict=True)),  # the probe times xla_panels at prefill
                "prefill": dict(zip(("kernel", "xla", "xla_panels"), prefill, strict=True))}

    split = figures((1, 2), (5, 4, 4.1))
    assert sel.verdict(split) == "cpu-kernel"
    assert sel.xla_rows_choice({"choice": "cpu-kernel", **split}, decode_rows=64) == 65
    close = figures((1, 2), (4.1, 4, 4.0))  # the kernel within 5% of both: it runs every call
    assert sel.verdict(close) == "cpu-kernel" and sel.xla_rows_choice({"choice": "cpu-kernel", **close}, 64) is None
    neither = figures((1, 2), (5, 4, 4.5))  # nothing in panels near XLA's own dot at the prefill rows
    assert sel.verdict(neither) == "xla" and sel.xla_rows_choice({"choice": "xla", **neither}, 64) is None

    def measure(shapes, names):
        return {n: {"choice": sel.verdict(split), **split} for n in names}

    monkeypatch.setattr(sel, "_in_process", {})
    monkeypatch.setattr(sel, "measure", measure)
    mesh = stage_mesh(jax.devices()[:1])
    got = sel.select(mesh, CFG, sel.KernelOptions(decode_attention="xla", prefill_attention="xla"), LIMITS)
    assert got.dense_matmuls == "cpu-kernel" and got.dense_xla_rows == LIMITS.max_num_seqs + 1
    assert got.kernels(mesh).dense.keywords == {"xla_rows": LIMITS.max_num_seqs + 1}


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(sel, "_in_process", {})


def _fake_measure(calls: list, dense: tuple, decode: tuple):
    def measure(shapes, names):
        calls.append(names)
        table = {"dense_matmuls": {"decode": _figures(*dense), "prefill": _figures(*dense)},
                 "decode_attention": {"decode": _figures(*decode)},
                 "prefill_attention": {"prefill": _figures(1, 2)}}
        return {n: {"choice": sel.verdict(table[n]), **table[n]} for n in names}

    return measure


def test_select_runs_the_measured_faster_path_and_remembers_it(tmp_path, monkeypatch, fresh):
    calls: list = []
    monkeypatch.setattr(sel, "measure", _fake_measure(calls, dense=(1, 2), decode=(3, 2)))
    mesh = stage_mesh(jax.devices()[:1])
    got = sel.select(mesh, CFG, sel.KernelOptions(), LIMITS, remember_in=str(tmp_path))
    assert (got.dense_matmuls, got.decode_attention, got.prefill_attention) == ("cpu-kernel", "xla", "cpu-kernel")
    assert got.panels and got.kernels(mesh).dense is not None and got.kernels(mesh).decode_attention is None
    assert calls == [("dense_matmuls", "decode_attention", "prefill_attention")]
    [saved] = tmp_path.glob("pipejax-cpu-kernels-*.json")
    assert json.loads(saved.read_text())["decode_attention"]["choice"] == "xla"

    # a new process (no in-process memo) reads the file: nothing is measured again
    monkeypatch.setattr(sel, "_in_process", {})
    monkeypatch.setattr(sel, "measure", _fake_measure(calls, dense=(2, 1), decode=(1, 2)))
    again = sel.select(mesh, CFG, sel.KernelOptions(), LIMITS, remember_in=str(tmp_path))
    assert (again.dense_matmuls, again.decode_attention) == ("cpu-kernel", "xla") and len(calls) == 1

    # an explicit choice wins over the verdict, and is not measured
    forced = sel.select(mesh, CFG, sel.KernelOptions("xla", "cpu-kernel", "xla"), LIMITS, remember_in=str(tmp_path))
    assert (forced.dense_matmuls, forced.decode_attention, forced.prefill_attention) == ("xla", "cpu-kernel", "xla")
    assert not forced.panels and len(calls) == 1


def test_only_what_can_run_is_measured(monkeypatch, fresh):
    """With tp = 2 the dense kernel cannot run (XLA's sharded dots keep the weights' layout): not measured, "xla"."""
    calls: list = []
    monkeypatch.setattr(sel, "measure", _fake_measure(calls, dense=(1, 2), decode=(1, 2)))
    got = sel.select(stage_mesh(jax.devices()[:2]), CFG, sel.KernelOptions(), LIMITS)
    assert calls == [("decode_attention", "prefill_attention")]
    assert (got.dense_matmuls, got.decode_attention) == ("xla", "cpu-kernel")
    with pytest.raises(ValueError, match=r"dense_matmuls='cpu-kernel' needs .* \(tp = 1\).*\(here: 2 cpu device"):
        sel.select(stage_mesh(jax.devices()[:2]), CFG, sel.KernelOptions(dense_matmuls="cpu-kernel"), LIMITS)


def test_the_verdict_key_changes_with_the_cpu_flags(monkeypatch):
    shapes = sel.probe_shapes(CFG, 1, LIMITS)
    avx2 = sel.host_signature(FLAGS.format(extra=""))
    avx512 = sel.host_signature(FLAGS.format(extra="avx512f avx512bw"))
    assert avx2["isa"] == "sse4_2,avx,avx2,fma" and avx512["isa"].endswith("avx512f,avx512bw")
    assert sel.verdict_key(avx2, shapes) != sel.verdict_key(avx512, shapes)
    assert sel.verdict_key(avx2, shapes) == sel.verdict_key(sel.host_signature(FLAGS.format(extra="")), shapes)
    assert sel.verdict_key(avx2, shapes) != sel.verdict_key(avx2, {**shapes, "decode_rows": 8})
    before = sel.verdict_key(avx2, shapes)  # and with the kernels' source: a verdict measured on other code is stale
    monkeypatch.setattr(sel, "_kernels_source", lambda: "other source")
    assert sel.verdict_key(avx2, shapes) != before


def test_the_probes_measure_both_paths_here():
    """The real probes on this host, at a tiny model's shapes: each verdict is what its own figures say."""
    shapes = sel.probe_shapes(CFG, 1, LIMITS)
    got = sel.measure(shapes, ("dense_matmuls", "decode_attention", "prefill_attention"))
    assert set(got["dense_matmuls"]) == {"choice", "decode", "prefill"}
    for name, v in got.items():
        figures = {k: f for k, f in v.items() if k != "choice"}
        assert all(f["kernel"] > 0 and f["xla"] > 0 for f in figures.values()), (name, v)
        assert v["choice"] == sel.verdict(figures), (name, v)


def test_bad_options_name_the_value_and_the_fix():
    with pytest.raises(ValueError, match="prefill_attention='flash'; use 'auto', 'xla' or 'cpu-kernel'"):
        sel.KernelOptions(prefill_attention="flash")
    with pytest.raises(ValueError, match="decode_layers='loop'; use 'auto', 'scan' or 'unrolled'"):
        sel.KernelOptions(decode_layers="loop")


@pytest.mark.parametrize("build", ["background", "cached"])
def test_kernels_not_built_yet_run_xla_without_waiting(monkeypatch, fresh, build):
    """Only the built kernels are measured; the others run XLA's formulation now, and with "background" are
    pending (built by a child process: test_cpu_kernel_build). A kernel remembered as slower needs no build."""
    calls: list = []
    monkeypatch.setattr(sel, "measure", _fake_measure(calls, dense=(1, 2), decode=(1, 2)))
    monkeypatch.setattr(sel, "built", lambda name: name == "decode_attention")
    mesh = stage_mesh(jax.devices()[:1])
    got = sel.select(mesh, CFG, sel.KernelOptions(build=build), LIMITS)
    assert (got.dense_matmuls, got.decode_attention, got.prefill_attention) == ("xla", "cpu-kernel", "xla")
    assert calls == [("decode_attention",)]
    assert got.pending == (("dense_matmuls", "prefill_attention") if build == "background" else ())
    assert sel.build_in_background(dataclasses.replace(got, pending=())) is None

    monkeypatch.setattr(sel, "_in_process", {})
    monkeypatch.setattr(sel, "known_choices", lambda *a: {"dense_matmuls": {"choice": "xla"}})
    again = sel.select(mesh, CFG, sel.KernelOptions(build=build), LIMITS)
    assert again.pending == (("prefill_attention",) if build == "background" else ())


def test_the_kernel_build_setting_is_checked():
    with pytest.raises(ValueError, match="build='soon'.*'background', 'wait' or 'cached'"):
        sel.KernelOptions(build="soon")
    with pytest.raises(ValueError, match="PIPEJAX_CPU_KERNEL_BUILD='soon'"):
        sel.cpu_kernel_build_from_env({"PIPEJAX_CPU_KERNEL_BUILD": "soon"})
    assert sel.cpu_kernel_build_from_env({}) == "background"
    assert sel.cpu_dense_tiles_from_env({}) == "auto"
    assert sel.cpu_dense_tiles_from_env({"PIPEJAX_CPU_DENSE_TILES": "amx"}) == "amx"
    with pytest.raises(ValueError, match="PIPEJAX_CPU_DENSE_TILES='tf32'; use one of auto, vector, amx, amx-kept"):
        sel.cpu_dense_tiles_from_env({"PIPEJAX_CPU_DENSE_TILES": "tf32"})


def _amx_figures(kernel: float, amx: float) -> dict:
    return {"kernel": kernel, "xla": 9.0, "amx": amx}


def test_amx_tiles_run_from_the_rows_they_won_at():
    """AMX's tiles from the decode rows where they won there; else from the rows above them where they won at the
    prefill rows; never where they lost at the prefill rows or were not measured (a CPU without them)."""
    assert sel.amx_choice({"decode": _amx_figures(1, 2), "prefill": _amx_figures(4, 3)}, 64, 512) == (65, None)
    assert sel.amx_choice({"decode": _amx_figures(2, 1), "prefill": _amx_figures(4, 3)}, 64, 512) == (64, None)
    assert sel.amx_choice({"decode": _amx_figures(2, 1), "prefill": _amx_figures(3, 4)}, 64, 512) == (None, None)
    assert sel.amx_choice({"decode": _figures(1, 2), "prefill": _figures(3, 4)}, 64, 512) == (None, None)


def test_kept_amx_tiles_run_from_the_decode_rows_where_they_won_there():
    """Tiles kept where they beat the FMA tiles at the decode rows: from there on, up to the prefill rows where
    splitting the weight at each call measured faster there; not kept where they lost at the decode rows."""
    def figures(kernel, amx, kept):
        return {"kernel": kernel, "xla": 9.0, "amx": amx, "amx_kept": kept}

    assert sel.amx_choice({"decode": figures(2, 3, 1), "prefill": figures(4, 3, 2)}, 64, 512) == (None, 64)
    assert sel.amx_choice({"decode": figures(2, 3, 1), "prefill": figures(4, 2, 3)}, 64, 512) == (512, 64)
    assert sel.amx_choice({"decode": figures(1, 3, 2), "prefill": figures(4, 3, 2)}, 64, 512) == (65, None)


@pytest.mark.parametrize("amx_here", [True, False])
def test_the_dense_tiles_follow_the_probe_or_the_option(monkeypatch, fresh, amx_here):
    """"auto" takes AMX's tiles as their probe says, where the CPU has them; "vector" never; "amx" on every call,
    and where the CPU has none it says what it needs. The kernel forced without a probe is measured for its tiles."""
    from pipejax.runner.cpu import dense

    calls: list = []

    def measure(shapes, names):
        calls.append(names)
        table = {"dense_matmuls": {"decode": _amx_figures(1, 2), "prefill": _amx_figures(4, 3)},
                 "decode_attention": {"decode": _figures(1, 2)}, "prefill_attention": {"prefill": _figures(1, 2)}}
        return {n: {"choice": sel.verdict(table[n]), **table[n]} for n in names}

    monkeypatch.setattr(sel, "measure", measure)
    monkeypatch.setattr(dense, "amx_ready", lambda: amx_here)
    mesh = stage_mesh(jax.devices()[:1])
    got = sel.select(mesh, CFG, sel.KernelOptions(), LIMITS)
    assert got.dense_matmuls == "cpu-kernel" and got.dense_amx_rows == (LIMITS.max_num_seqs + 1 if amx_here else None)
    assert sel.select(mesh, CFG, sel.KernelOptions(dense_tiles="vector"), LIMITS).dense_amx_rows is None
    monkeypatch.setattr(sel, "_in_process", {})
    forced = sel.select(mesh, CFG, sel.KernelOptions("cpu-kernel", "xla", "xla"), LIMITS)
    assert calls[-1] == (("dense_matmuls",) if amx_here else ("dense_matmuls", "decode_attention", "prefill_attention"))
    assert forced.dense_amx_rows == (LIMITS.max_num_seqs + 1 if amx_here else None)
    if amx_here:
        split = sel.select(mesh, CFG, sel.KernelOptions(dense_tiles="amx"), LIMITS)
        kept = sel.select(mesh, CFG, sel.KernelOptions(dense_tiles="amx-kept"), LIMITS)
        assert (split.dense_amx_rows, split.dense_kept_rows, split.keeps_tiles) == (1, None, False)
        assert (kept.dense_amx_rows, kept.dense_kept_rows, kept.keeps_tiles) == (None, 1, True)
    else:
        for tiles in ("amx", "amx-kept"):
            with pytest.raises(ValueError, match=f"dense_tiles='{tiles}' needs a CPU with AMX's bf16 tiles .* use "
                                                 "'auto' or 'vector'"):
                sel.select(mesh, CFG, sel.KernelOptions(dense_tiles=tiles), LIMITS)
    with pytest.raises(ValueError, match="dense_tiles='tf32'; use 'auto', 'vector', 'amx' or 'amx-kept'"):
        sel.KernelOptions(dense_tiles="tf32")
