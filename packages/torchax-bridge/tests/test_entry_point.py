"""The runner finds the bridge by name through the pipejax.model_impls entry point."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

from pipejax.runner.model_impl import ENTRY_POINT_GROUP, get_model_impl


def test_runner_finds_torchax_impl():
    from pipejax.torchax_bridge.impl import TORCHAX_IMPL, load_stage_params, stage_forward

    assert "torchax" in {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}
    impl = get_model_impl("torchax")
    assert impl is TORCHAX_IMPL and impl.name == "torchax"
    assert impl.load_params is load_stage_params and impl.forward is stage_forward
    assert get_model_impl("jax").name == "jax"  # native stays the default


def test_package_import_is_cheap():
    """Importing the package (as a loader might) does not import torch; its names load on use."""
    code = (
        "import sys, pipejax.torchax_bridge as b\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "assert b.TORCHAX_IMPL.name == 'torchax' and 'torch' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
