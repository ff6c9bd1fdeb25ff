"""The CPU attention kernels' vectorized exp against numpy's, over the range a softmax feeds it."""

import numpy as np

from pipejax.runner.cpu_vector_exp import exp_shifted_sum


def test_matches_numpy_exp_and_sums():
    x = np.concatenate([np.linspace(-87, 0, 20001), [0.0, -1e-8, -0.5, -0.34657, -86.99]]).astype(np.float32)
    row = np.concatenate([[123.0], x + np.float32(2.5), [456.0]]).astype(np.float32)  # outside [lo, hi): untouched
    total = exp_shifted_sum(row, 1, len(row) - 1, np.float32(2.5))
    want = np.exp((x + np.float32(2.5)).astype(np.float64) - 2.5)
    np.testing.assert_allclose(row[1:-1], want, rtol=2e-6, atol=0)
    assert row[0] == 123.0 and row[-1] == 456.0
    np.testing.assert_allclose(total, want.sum(), rtol=1e-5)
    assert exp_shifted_sum(np.array([5.0, -200.0], np.float32), 0, 2, np.float32(5.0)) >= 1.0  # far below: no NaN
