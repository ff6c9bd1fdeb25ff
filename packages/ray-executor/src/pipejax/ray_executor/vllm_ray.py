"""The Ray cluster vLLM's engine core will place pipejax's stages on, checked before vLLM starts it: the
``pipejax.vllm_ray_checks`` entry point, which pipejax's vLLM platform calls from its config check in CPU
mode under ``distributed_executor_backend='ray'`` (the platform layer imports no Ray).

vLLM's Ray executors ask for one ``Platform.ray_device_key`` ("TPU") per stage and wait up to 30 min for
them (``PG_WAIT_TIMEOUT`` in vllm/v1/executor/ray_utils.py). In CPU mode that resource is only a label:
Ray lists it where ``ray start --resources`` declared it, and never on the cluster vLLM's engine core starts
by itself (``ray.init()`` with no ``RAY_ADDRESS`` and no ``ray start`` cluster on this machine). Both are
refused here in seconds, naming the resource and the fix.

The cluster is read from a short-lived subprocess, never by connecting this process: vLLM forks its
engine core from here next, and a process forked after Ray's gRPC client ran hangs in ``ray.init``.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

PROBE_TIMEOUT_S = 60.0
_PROBE = """
import json, logging, sys
import ray
ray.init(address=sys.argv[1], log_to_driver=False, logging_level=logging.ERROR)
print("RESOURCES " + json.dumps(ray.cluster_resources()), flush=True)
"""


def check_cluster(device_key: str, stages: int) -> None:
    """ValueError, naming ``device_key`` and the ``ray start`` fix, when the cluster vLLM's engine core will
    join lists fewer than ``stages`` of ``device_key``, or when it would start a cluster of its own."""
    import ray
    import vllm.envs
    from ray._private.services import canonicalize_bootstrap_address

    fix = f"ray start --head --resources '{{\"{device_key}\": {stages}}}'"
    here = ray.get_runtime_context().gcs_address if ray.is_initialized() else None
    # The engine core keeps this process's connection when it runs here or vLLM runs inside a Ray actor (it
    # then hands the engine core RAY_ADDRESS); else its ray.init() goes where a bare ray.init() would:
    # RAY_ADDRESS, else the last `ray start` cluster on this machine, else a new cluster of its own.
    joins_here = here is not None and (not vllm.envs.VLLM_ENABLE_V1_MULTIPROCESSING
                                       or ray.get_runtime_context().get_actor_id() is not None)
    address = here if joins_here else canonicalize_bootstrap_address(None)
    if address is None:
        hint = (f" This process is connected to the Ray cluster at {here}, which vLLM's engine-core process "
                f"does not join by itself: set RAY_ADDRESS={here} before creating the engine." if here else "")
        raise ValueError(
            f"distributed_executor_backend='ray' in pipejax's CPU mode: with no Ray cluster to join (RAY_ADDRESS "
            f"unset, no `ray start` cluster on this machine) vLLM would start one of its own, which lists no "
            f"'{device_key}' resource, and wait 30 min for {stages} (one per pipeline stage). Start Ray declaring "
            f"them first: {fix}; or use distributed_executor_backend='mp'.{hint}"
        )
    if here is not None and canonicalize_bootstrap_address(here) == canonicalize_bootstrap_address(address):
        total = ray.cluster_resources().get(device_key, 0)
    else:
        total = _probe(address).get(device_key, 0)
    if total < stages:
        raise ValueError(
            f"distributed_executor_backend='ray': the Ray cluster at {address} that vLLM will use lists "
            f"{total:g} '{device_key}' resources, and vLLM's Ray executors place each of the {stages} pipeline "
            f"stages by one (in pipejax's CPU mode '{device_key}' only counts stages). Declare them where Ray "
            f"starts: {fix} (or on a node joining it: ray start --address={address} --resources "
            f"'{{\"{device_key}\": {math.ceil(stages - total)}}}'); `ray status` shows what the cluster lists."
        )


def _probe(address: str) -> dict[str, float]:
    """The cluster's total resources, read by a child process that connects to ``address``."""
    try:
        proc = subprocess.run([sys.executable, "-c", _PROBE, address], capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ValueError(f"distributed_executor_backend='ray': the Ray cluster at {address} (RAY_ADDRESS, or the "
                         f"last `ray start` on this machine) did not answer within {PROBE_TIMEOUT_S:.0f}s; "
                         f"`ray status` shows whether it runs") from None
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESOURCES ")]
    if proc.returncode != 0 or not lines:
        raise ValueError(f"distributed_executor_backend='ray': cannot connect to the Ray cluster at {address} "
                         f"(RAY_ADDRESS, or the last `ray start` on this machine; `ray status` shows whether it "
                         f"runs):\n{proc.stderr[-2000:]}")
    return json.loads(lines[-1].removeprefix("RESOURCES "))
