"""The library choice for the dots of few-row decode steps on XLA:CPU (``cpu_dots``)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipejax.pp_utils import stage_mesh
from pipejax.runner.cpu import dots as cpu_dots
from pipejax.runner.step_inputs import StepShape


def test_the_compiler_option_turns_ynnpack_dots_off():
    """The option the few-row steps compile with still does what it says in this jaxlib: a dot that XLA:CPU
    hands to YNNPACK by default is XLA's own without it, with the same result."""
    x, w = jnp.ones((16, 256)), jnp.full((256, 512), 0.5)
    default = jax.jit(lambda a, b: a @ b).lower(x, w).compile()
    without = jax.jit(lambda a, b: a @ b, compiler_options=cpu_dots.WITHOUT_YNNPACK).lower(x, w).compile()
    assert "__ynn_fusion" in default.as_text()
    assert "__ynn_fusion" not in without.as_text()
    np.testing.assert_array_equal(np.asarray(default(x, w)), np.asarray(without(x, w)))


def test_only_decode_steps_of_a_few_rows_qualify():
    lo, hi = cpu_dots.FEW_ROWS
    assert cpu_dots.few_rows(StepShape(tokens=16, prefill_rows=0, query=1, decode_rows=lo, blocks=4))
    assert cpu_dots.few_rows(StepShape(tokens=32, prefill_rows=0, query=1, decode_rows=hi, blocks=4))
    assert not cpu_dots.few_rows(StepShape(tokens=16, prefill_rows=0, query=1, decode_rows=1, blocks=4))
    assert not cpu_dots.few_rows(StepShape(tokens=64, prefill_rows=0, query=1, decode_rows=2 * hi, blocks=4))
    assert not cpu_dots.few_rows(StepShape(tokens=64, prefill_rows=1, query=32, decode_rows=lo, blocks=4))


def test_the_runner_measures_or_takes_the_choice(tmp_path):
    from hf_oracle import make_hf_checkpoint

    from pipejax.runner.config import CacheConfig
    from pipejax.runner.runner import StageRunner

    make_hf_checkpoint(tmp_path, "LlamaForCausalLM", max_position_embeddings=64)
    mesh, cache = stage_mesh(jax.devices()[:1]), CacheConfig(num_blocks=8)
    assert StageRunner(tmp_path, mesh, cache=cache).few_row_dots == cpu_dots.choice(None) == cpu_dots.measured_choice()
    assert cpu_dots.measured_choice() in cpu_dots.CHOICES
    for choice in cpu_dots.CHOICES:
        assert StageRunner(tmp_path, mesh, cache=cache, few_row_dots=choice).few_row_dots == choice
    with pytest.raises(ValueError, match="few_row_dots='mkl'; use 'auto', 'ynnpack' or 'eigen'"):
        StageRunner(tmp_path, mesh, cache=cache, few_row_dots="mkl")


def test_the_choice_is_remembered_in_the_cache_folder(tmp_path, monkeypatch):
    """A later process reads the choice the first one measured (its cached programs depend on it); a file it
    cannot use is measured over."""
    calls = []
    monkeypatch.setattr(cpu_dots, "measured_choice", lambda: calls.append(1) or "ynnpack")
    cpu_dots.choice.cache_clear()
    try:
        assert cpu_dots.choice(str(tmp_path / "cache")) == "ynnpack" and calls == [1]
        path = cpu_dots.remembered_choice_path(str(tmp_path / "cache"))
        assert open(path).read() == "ynnpack" and os.listdir(tmp_path / "cache") == [os.path.basename(path)]
        with open(path, "w") as f:
            f.write("eigen")  # what an earlier process on this machine measured
        cpu_dots.choice.cache_clear()
        assert cpu_dots.choice(str(tmp_path / "cache")) == "eigen" and calls == [1]
        with open(path, "w") as f:
            f.write("mkl")
        cpu_dots.choice.cache_clear()
        assert cpu_dots.choice(str(tmp_path / "cache")) == "ynnpack" and calls == [1, 1]
        assert open(path).read() == "ynnpack"
    finally:
        cpu_dots.choice.cache_clear()
