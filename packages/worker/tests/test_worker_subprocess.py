"""The last stage in a real separate OS process: stage 0 is a StageWorker in this pytest process
(tp=2 on devices 0-1 of 8), stage 1 a StageWorker in a child process with its own 2 simulated
devices. Activations move by TransferServerTransport; the test is the driver and sends the same
``ModelBatch`` to both (pickled over the child's stdin) and gets the ``SamplerOutput`` back."""

import os
import pickle
import subprocess
import sys

import jax
import pytest
from worker_oracle import CACHE, LIMITS, MAX_NEW_TOKENS, PROMPTS, greedy_decode

from pipejax.pp_utils import TransferServerTransport
from pipejax.runner.batch import ModelBatch
from pipejax.runner.config import StageConfig
from pipejax.worker import StageInfo, StageWorker, WorkerConfig

pytestmark = pytest.mark.timeout(90)

# The stage process: a tiny RPC server around one StageWorker. Requests on stdin are pickled
# (method name, args) tuples; answers go back pickled as ("ok", value) or ("error", exception).
STAGE_SCRIPT = r"""
import os, pickle, sys
answers = os.fdopen(os.dup(1), "wb")  # a private copy of stdout; whatever else is printed goes to stderr
os.dup2(2, 1)
from pipejax.pp_utils import TransferServerTransport
from pipejax.worker import StageWorker

config, previous_address = pickle.load(sys.stdin.buffer)
transport = TransferServerTransport("127.0.0.1", bulk_connections=2)
transport.connect_previous(previous_address, "stage 0")
worker = StageWorker(config, recv=transport)
pickle.dump(("ok", worker.info()), answers)
answers.flush()
while True:
    try:
        method, args = pickle.load(sys.stdin.buffer)
    except EOFError:
        break
    try:
        attr = getattr(worker, method)
        answer = ("ok", attr(*args) if callable(attr) else attr)
    except Exception as e:
        answer = ("error", e)
    pickle.dump(answer, answers)
    answers.flush()
"""


class StageProcess:
    """A StageWorker in a child process with its own ``num_devices`` simulated CPU devices."""

    def __init__(self, config: WorkerConfig, previous_address: str, stderr_path, num_devices: int = 2):
        env = {
            **os.environ,
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={num_devices}",
            "JAX_PLATFORMS": "cpu",
        }
        self.stderr_path = stderr_path
        with open(stderr_path, "wb") as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", STAGE_SCRIPT],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                env=env,
            )
        self._send((config, previous_address))
        self.info: StageInfo = self._answer()

    def call(self, method: str, *args):
        self._send((method, args))
        return self._answer()

    def _send(self, message) -> None:
        pickle.dump(message, self.proc.stdin)
        self.proc.stdin.flush()

    def _answer(self):
        try:
            status, value = pickle.load(self.proc.stdout)
        except EOFError:
            log = open(self.stderr_path, errors="replace").read()[-4000:]
            raise RuntimeError(f"stage process exited with {self.proc.wait(timeout=10)}:\n{log}") from None
        if status == "error":
            raise value
        return value

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def test_last_stage_in_another_process_equals_transformers(checkpoint, hf_expected, tmp_path):
    path = str(checkpoint[0])
    # bulk_connections defaults to one per local device (8 here, 2 in the child); a receiver with
    # fewer bulk sockets than its sender aborts inside JAX's transfer server (socket_bulk_transport
    # "Check failed: bind ... Bad file descriptor"), so both ends use 2.
    first = StageWorker(
        WorkerConfig(path, StageConfig(0, 2), tp_size=2, cache=CACHE, scheduler=LIMITS),
        jax.devices()[0:2],
        send=TransferServerTransport("127.0.0.1", bulk_connections=2),
    )
    last_config = WorkerConfig(
        path, StageConfig(1, 2), tp_size=2, cache=CACHE, scheduler=LIMITS, receive_timeout_s=60, step_trace_len=64
    )
    last = StageProcess(last_config, first.send.address, tmp_path / "stage1.stderr")
    try:
        assert last.info.pp_rank == 1 and last.info.layers == (2, 4)
        assert last.info.devices == ("cpu:0", "cpu:1")  # the child's own two devices
        assert last.info.pid == last.proc.pid != os.getpid()

        num_blocks = min(first.available_kv_blocks(), last.call("available_kv_blocks"))
        first.load(num_blocks)
        last.call("load", num_blocks)

        def execute(batch: ModelBatch):
            assert first.execute_model(batch) is None  # sent to the child's transfer server
            return last.call("execute_model", batch)

        assert greedy_decode(execute, PROMPTS, MAX_NEW_TOKENS) == hf_expected
        assert [step for _, step, _, _ in last.call("step_trace")] == list(range(MAX_NEW_TOKENS))
    finally:
        last.close()
    assert last.proc.returncode == 0
