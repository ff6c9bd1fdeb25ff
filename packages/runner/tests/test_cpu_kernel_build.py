"""A stage whose CPU kernels numba has not built on the host yet ("background"): it serves on XLA's formulation
while a child process builds them, then measures them and switches between two steps, greedy outputs staying
those of transformers throughout."""

import contextlib
import time

from hf_oracle import ChainedStages, greedy_generate, hf_greedy, make_hf_checkpoint

from pipejax.runner.cpu import build
from pipejax.runner.cpu import select as sel

PROMPTS = [[3, 14, 15, 92, 65], [35, 89, 79]]
BUILD_TIMEOUT_S = 300  # a cold numba cache: each kernel ~5-12 s of one core, the child at a lower priority


def test_a_stage_runs_xla_until_its_kernels_are_built_then_switches(tmp_path, monkeypatch):
    model = make_hf_checkpoint(tmp_path, "LlamaForCausalLM", hidden_size=128, num_attention_heads=4,
                               num_key_value_heads=2)  # head dim 32: every kernel fits
    expected = hf_greedy(model, PROMPTS, 8)
    really_built = sel.built
    monkeypatch.setattr(sel, "_in_process", {})
    monkeypatch.setattr(sel, "built", lambda name: False)  # numba's cache as on a fresh install
    with contextlib.ExitStack() as held:
        for name in sel.KERNEL_NAMES:  # as if another process on the host were building them: the children wait
            held.enter_context(build._compiling(sel._wrappers()[name].KERNEL))
        stages = ChainedStages(tmp_path, 2, 1, num_blocks=80, kernel_build="background")
        for s in stages.stages:
            assert s.selection.pending == sel.KERNEL_NAMES
            assert (s.dense_matmuls, s.decode_attention, s.prefill_attention) == ("xla", "xla", "xla")
        assert greedy_generate(stages, PROMPTS, 8, chunk=4) == expected  # served while the kernels build
        assert not any(s._kernel_build.finished() for s in stages.stages)

    deadline = time.monotonic() + BUILD_TIMEOUT_S
    while not all(s._kernel_build.finished() for s in stages.stages):  # the real child processes
        assert time.monotonic() < deadline, "the background build did not finish"
        time.sleep(0.2)
    assert all(s._kernel_build.succeeded for s in stages.stages)
    monkeypatch.setattr(sel, "built", really_built)
    # every kernel measured faster here (the probes themselves are test_cpu_select's)
    monkeypatch.setattr(sel, "measure", lambda shapes, names: {n: {"choice": "cpu-kernel"} for n in names})
    assert greedy_generate(stages, PROMPTS, 8, chunk=4) == expected  # the first step switches
    for s in stages.stages:
        assert s._kernel_build is None and s.selection.pending == ()
        assert (s.decode_attention, s.prefill_attention) == ("cpu-kernel", "cpu-kernel")
        assert s.dense_matmuls == "xla"  # its weights were laid out for XLA's dots: from the next start


def test_weights_kept_quantized_run_xla_until_their_kernel_is_built(tmp_path, monkeypatch):
    """int8 weights in panels on one CPU device: while the quantized kernel builds in the background, XLA
    dequantizes them (``Kernels.quantized_dense`` None); once built, the stage switches to the kernel; greedy
    outputs are transformers' on the same fake-quantized weights throughout."""
    import transformers
    from pipejax_test_support import fake_quantize_

    make_hf_checkpoint(tmp_path, "LlamaForCausalLM", hidden_size=128, intermediate_size=128, num_attention_heads=4,
                       tie_word_embeddings=False)
    oracle = fake_quantize_(transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval(), "int8")
    oracle.generation_config.eos_token_id = None
    expected = hf_greedy(oracle, PROMPTS, 8)
    really_built = sel.built
    monkeypatch.setattr(sel, "_in_process", {})
    monkeypatch.setattr(sel, "built", lambda name: False)
    with contextlib.ExitStack() as held:
        for name in (*sel.KERNEL_NAMES, sel.QUANTIZED_KERNEL):
            held.enter_context(build._compiling(sel._wrappers()[name].KERNEL))
        stages = ChainedStages(tmp_path, 1, 1, num_blocks=80, kernel_build="background", quantization="int8")
        (stage,) = stages.stages
        assert sel.QUANTIZED_KERNEL in stage.selection.pending and not stage.selection.quantized_kernel
        assert stage.selection.kernels(stage.mesh).quantized_dense is None
        assert greedy_generate(stages, PROMPTS, 8, chunk=4) == expected
        assert not stage._kernel_build.finished()
    deadline = time.monotonic() + BUILD_TIMEOUT_S
    while not stage._kernel_build.finished():
        assert time.monotonic() < deadline, "the background build did not finish"
        time.sleep(0.2)
    monkeypatch.setattr(sel, "built", really_built)
    monkeypatch.setattr(sel, "measure", lambda shapes, names: {n: {"choice": "xla"} for n in names})
    assert greedy_generate(stages, PROMPTS, 8, chunk=4) == expected  # the first step switches
    assert stage.selection.quantized_kernel and stage.selection.kernels(stage.mesh).quantized_dense is not None
