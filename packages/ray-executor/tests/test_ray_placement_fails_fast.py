"""pipejax's own Ray placement on a cluster whose nodes can never hold the stages: in CPU mode the stages'
resource is a label that nodes declare when Ray starts, so the engine refuses at once, naming the resource
and the ``ray start`` fix, instead of waiting out ``placement_timeout_s``."""

import os
import time

import pytest
import ray

from pipejax.ray_executor import LLM
from pipejax.ray_executor.executor.ray_placement import (
    CPU_DEVICE_RESOURCE,
    TPU_RESOURCE,
    StageUnits,
    refuse_unplaceable,
)

pytestmark = pytest.mark.timeout(300)
PLACEMENT_TIMEOUT_S = 60.0  # what the refusal must not wait out


@pytest.fixture(scope="module")
def two_devices():
    """A local cluster (the driver connected) of one node declaring 2 simulated devices."""
    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray.init(address="local", num_cpus=1, resources={CPU_DEVICE_RESOURCE: 2}, include_dashboard=False,
             log_to_driver=False)
    yield
    ray.shutdown()


def test_engine_refuses_at_once_when_no_node_holds_its_stages(two_devices):
    start = time.monotonic()
    with pytest.raises(ValueError, match=f"cannot place 2 stages of 2 '{CPU_DEVICE_RESOURCE}'") as refused:
        LLM("builtin", pipeline_parallel_size=2, tensor_parallel_size=2, distributed_executor_backend="ray",
            num_kv_blocks=64, warmup=False, placement_timeout_s=PLACEMENT_TIMEOUT_S)
    elapsed = time.monotonic() - start
    assert elapsed < 30, f"refused after {elapsed:.1f}s (placement timeout {PLACEMENT_TIMEOUT_S:.0f}s)"
    assert f"""ray start --head --resources '{{"{CPU_DEVICE_RESOURCE}": 4}}'""" in str(refused.value)
    assert ray.util.placement_group_table() == {} or all(  # nothing was left reserved
        pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())


def test_what_fits_is_placed_and_tpu_chips_are_left_to_the_timeout(two_devices):
    refuse_unplaceable(StageUnits(CPU_DEVICE_RESOURCE, 1), 2)  # two stages of one device: they fit
    with pytest.raises(ValueError, match="its nodes hold 2"):
        refuse_unplaceable(StageUnits(CPU_DEVICE_RESOURCE, 1), 3, "-dp/-pp/-tp")  # e.g. 3 DP engines of 1 stage
    refuse_unplaceable(StageUnits(TPU_RESOURCE, 4), 2)  # no TPU node yet: an autoscaler may add them
