import os

# Simulated devices must be configured before JAX is imported anywhere.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import pytest  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "extra: slower checks, run only by `nox -s multihost_extra` (multihost/), "
                            "`nox -s vllm -- -m extra` (vllm_host/) and `nox -s ray_executor_extra` (the rest)")
    config.addinivalue_line("markers", "slow: minutes-long checks on the default model, run by `nox -s serve_defaults`")


@pytest.fixture(scope="session", autouse=True)
def _builtin_model_cache(tmp_path_factory):
    """The built-in model is generated into a per-run folder, not the user's cache."""
    os.environ["PIPEJAX_CACHE_DIR"] = str(tmp_path_factory.mktemp("pipejax-cache"))


@pytest.fixture(scope="session", autouse=True)
def _cpu_kernels_built():
    """numba's cache holds the CPU kernels before any engine starts, as after a host's first serving start: the
    engines' default "background" build would otherwise switch a test's stages from XLA's formulation to the
    kernels at a moment set by the build (``test_kernel_build`` checks that path on purpose)."""
    from pipejax.runner.cpu import select

    select.build_all(select.KERNEL_NAMES)
