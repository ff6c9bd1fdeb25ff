"""The body of one stage's Ray actor: a ``StageWorker`` plus its end of the PP transport.

The actor is created before it knows its rank, so nothing JAX-related is imported at creation
(JAX reads ``JAX_PLATFORMS`` once, at import): the executor first asks where it runs and what
host that is (``host_report``: detected here, on the stage's own node, with the TPU chips Ray
granted it), ranks the actors, sets each one's environment (its chips / simulated devices), and
only then ``init_worker`` imports JAX and builds the stage. After
that, ``call`` reaches any method of the stage's ``StageWorker`` (the executor's ``collective_rpc``).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from typing import Any

import ray

from pipejax.ray_executor.executor.compiled_graph import execute_step


class StageActor:
    def __init__(self):
        self.worker = None
        self.transport = None

    # --- before JAX -------------------------------------------------------------------------

    def node_info(self) -> dict[str, Any]:
        ctx = ray.get_runtime_context()
        return {
            "node_id": ctx.get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }

    def host_report(self, platform_plugin: str | None = None) -> dict[str, Any]:
        """Where this actor runs and what that host is, found here: the platform's cheap detection of
        this host (never JAX) and the TPU chip ids Ray granted this actor (none on CPU). ``platform_plugin``:
        the driver's choice of platform (``EngineConfig.platform_plugin``)."""
        from pipejax.ray_executor.platforms import current_platform

        granted = ray.get_runtime_context().get_accelerator_ids().get("TPU", [])
        detected = current_platform(platform_plugin).detect_host()
        return {**self.node_info(), "detected": detected, "granted_tpu_ids": list(granted)}

    def environment(self) -> dict[str, Any]:
        """This process's environment as it stands, and whether JAX is loaded yet (tests, debugging)."""
        return {"env": dict(os.environ), "jax_loaded": "jax" in sys.modules}

    def allowed_cpus(self) -> list[int]:
        return sorted(os.sched_getaffinity(0))

    def set_environment(self, env: dict[str, str], cpus: list[int] | None = None) -> None:
        """Before JAX is imported: its variables, and optionally the cores this process may use (XLA
        sizes its CPU thread pool from the affinity mask)."""
        os.environ.update(env)
        if cpus is not None:
            os.sched_setaffinity(0, cpus)

    # --- the stage --------------------------------------------------------------------------

    def init_worker(self, worker_config, host_ip: str, name: str = "") -> str:
        """Build the stage on this process's devices; returns this stage's transfer-server address."""
        from pipejax.pp_utils import TransferServerTransport
        from pipejax.worker import StageWorker

        _log_to_stderr()
        self.name = name or f"stage {worker_config.stage.pp_rank}"
        self.transport = TransferServerTransport(host=host_ip)
        stage = worker_config.stage
        recv = self.transport if not stage.is_first else None
        send = self.transport if not stage.is_last else None
        self.worker = StageWorker(worker_config, recv=recv, send=send)
        return self.transport.address

    def connect_previous(self, address: str, peer: str) -> None:
        self.transport.connect_previous(address, peer)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``method(*args, **kwargs)`` of this stage's ``StageWorker``: every per-stage call but the
        compiled-graph step goes through here (``Executor.collective_rpc``, ``execute_model``)."""
        return getattr(self.worker, method)(*args, **kwargs)

    def execute_step(self, incoming, _pull_started=None):
        """This stage's node in the compiled graph (see compiled_graph.py); after ``prefetch_step``'s node."""
        return execute_step(self, incoming, self.name)

    def prefetch_step(self, batch) -> None:
        """The compiled graph's ``prefetch``: the batch straight from the driver, before the previous stage's
        control message. A failure here only means the step pulls its activations itself."""
        try:
            if self.worker is not None:
                self.worker.prefetch(batch)
        except Exception:
            logging.getLogger(__name__).exception("prefetch of step %s", getattr(batch, "step_id", "?"))

    def drained(self) -> bool:
        """Answers once every call queued before it has run (the executor waits for a stage's stale steps)."""
        return True

    @ray.method(concurrency_group="health")
    def ping(self) -> bool:
        return True

    @ray.method(concurrency_group="health")
    def progress(self) -> int:
        """The newest step this stage finished, answered while a step runs: a step past its deadline waits on
        the first stage that has not finished it (``RayExecutor.hung_stages``)."""
        return self.worker.finished_step if self.worker is not None else -1

    @ray.method(concurrency_group="prefetch")
    def prefetch(self, batch) -> None:
        """While earlier steps run: start pulling ``batch``'s activations (``StageWorker.prefetch``)."""
        if self.worker is not None:
            self.worker.prefetch(batch)

    @ray.method(concurrency_group="health")
    def abort_receives(self) -> None:
        """While a step runs: its wait for the previous stage's activations (and every later one) fails at once,
        until ``connect_previous`` (the previous stage is being replaced)."""
        if self.transport is not None:
            self.transport.abort_receives()


def _log_to_stderr() -> None:
    """pipejax's INFO lines (a step shape compiling, a cache sized) go to this actor's stderr, which Ray keeps
    in the worker's log and forwards to the driver: an operator sees a compile in the middle of serving."""
    logger = logging.getLogger("pipejax")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
