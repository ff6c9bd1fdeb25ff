"""The CPU kernels' vectorized exp against numpy's: over [-87, 88] (the SiLU's range), and as the softmax's
numerators (values shifted by their maximum)."""

import numpy as np

from pipejax.runner.cpu.vector_exp import exp_f32, softmax_numerators


def test_exp_matches_numpy():
    for x in np.linspace(-87, 88, 4001).astype(np.float32):
        np.testing.assert_allclose(exp_f32(x), np.exp(np.float64(x)), rtol=3e-7, err_msg=f"x = {x}")
    assert np.isfinite(exp_f32(np.float32(500.0))) and exp_f32(np.float32(-500.0)) >= 0.0  # clamped, not inf/NaN


def test_softmax_numerators_match_numpy_and_sum():
    x = np.concatenate([np.linspace(-87, 0, 20001), [0.0, -1e-8, -0.5, -0.34657, -86.99]]).astype(np.float32)
    row = np.concatenate([[123.0], x + np.float32(2.5), [456.0]]).astype(np.float32)  # outside [lo, hi): untouched
    total = softmax_numerators(row, 1, len(row) - 1)  # the maximum is 2.5
    want = np.exp((x + np.float32(2.5)).astype(np.float64) - 2.5)
    np.testing.assert_allclose(row[1:-1], want, rtol=2e-6, atol=0)
    assert row[0] == 123.0 and row[-1] == 456.0
    np.testing.assert_allclose(total, want.sum(), rtol=1e-5)
    assert softmax_numerators(np.array([5.0, -200.0], np.float32), 0, 2) >= 1.0  # far below: no NaN
