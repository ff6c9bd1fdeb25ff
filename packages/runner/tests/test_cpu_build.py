"""``cpu.build``: kernels missing from numba's cache compile in child processes alongside this one (a fresh
install waits for its slowest kernel, not the sum), one build per kernel at a time on a host, and a child that
fails only costs the time it took."""

import logging
import os
import subprocess
import sys
import textwrap
import time

from pipejax.runner.cpu import build

# In a fresh process with an empty numba cache (numba reads NUMBA_CACHE_DIR when it is imported): the dense
# kernel (the quickest to compile) is not cached, a child fills the cache, then this process finds it there.
_FILL = textwrap.dedent("""
    from pipejax.runner.cpu import build
    module = "pipejax.runner.cpu.dense_kernel"
    assert not build.cached(module)
    children = build.fill_cache_alongside([module])
    assert len(children) == 1, children
    build.wait(children)
    assert children[0].returncode == 0
    assert build.cached(module)
    print("filled")
""")


def test_a_child_fills_numbas_cache(tmp_path):
    if (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()) < 2:
        import pytest

        pytest.skip("one core: fill_cache_alongside starts no child")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    run = subprocess.run([sys.executable, "-c", _FILL], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "filled" in run.stdout, run.stderr[-2000:]
    assert any(name.startswith("dense_kernel._handler_parallel") for _, _, files in os.walk(tmp_path / "numba")
               for name in files)


def test_a_failing_child_is_logged_not_raised(caplog):
    children = [subprocess.Popen([sys.executable, "-m", build.__name__, "pipejax.no_such_kernel"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)]
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        build.wait(children, timeout_s=120)
    assert children[0].returncode != 0
    assert "pipejax.no_such_kernel" in caplog.text and "No module named" in caplog.text


def test_one_build_per_kernel_at_a_time(tmp_path):
    """While this process holds a kernel's build lock, another process waits for it."""
    code = textwrap.dedent("""
        import time
        from pipejax.runner.cpu import build
        with build._compiling("pipejax.test_lock"):
            print(time.time())
    """)
    with build._compiling("pipejax.test_lock"):
        other = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        time.sleep(3.0)
        assert other.poll() is None  # still waiting
        released = time.time()
    out, _ = other.communicate(timeout=60)
    assert other.returncode == 0 and float(out) >= released
