"""The body of one stage's Ray actor: a ``StageWorker`` plus its end of the PP transport.

The actor is created before it knows its rank, so nothing JAX-related is imported at creation:
the executor first asks where it runs, ranks the actors, sets each one's environment (visible
chips / simulated devices), and only then ``init_worker`` imports JAX and builds the stage.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import ray

from pipejax.ray_executor.executor.compiled_graph import execute_step


class StageActor:
    def __init__(self):
        self.worker = None
        self.transport = None
        self.bytes_sent = 0

    # --- before JAX -------------------------------------------------------------------------

    def node_info(self) -> dict[str, Any]:
        ctx = ray.get_runtime_context()
        return {
            "node_id": ctx.get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }

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

        self.name = name or f"stage {worker_config.stage.pp_rank}"
        self.transport = TransferServerTransport(host=host_ip)
        stage = worker_config.stage
        recv = self.transport if not stage.is_first else None
        send = _CountingSend(self) if not stage.is_last else None
        self.worker = StageWorker(worker_config, recv=recv, send=send)
        return self.transport.address

    def connect_previous(self, address: str, peer: str) -> None:
        self.transport.connect_previous(address, peer)

    def available_kv_blocks(self) -> int:
        return self.worker.available_kv_blocks()

    def load(self, num_blocks: int) -> None:
        self.worker.load(num_blocks)

    def warmup_batches(self):
        return self.worker.warmup_batches()

    def warmup(self, batches) -> float:
        return self.worker.warmup(batches, progress=False)

    def execute_model(self, batch):
        return self.worker.execute_model(batch)

    def execute_step(self, incoming):
        """This stage's node in the compiled graph (see compiled_graph.py)."""
        return execute_step(self, incoming, self.name)

    def info(self):
        return self.worker.info()

    def trace(self):
        return list(self.worker.trace)

    def activation_bytes_sent(self) -> int:
        return self.bytes_sent

    @ray.method(concurrency_group="health")
    def ping(self) -> bool:
        return True


class _CountingSend:
    """Sends through the actor's transport and counts the activation bytes (for tests/benchmarks)."""

    def __init__(self, actor: StageActor):
        self.actor = actor

    def send(self, step_id, tensors) -> None:
        self.actor.bytes_sent += sum(int(v.nbytes) for v in tensors.values())
        self.actor.transport.send(step_id, tensors)
