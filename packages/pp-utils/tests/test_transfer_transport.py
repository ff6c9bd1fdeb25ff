"""TransferServerTransport: activations pulled across real OS processes by JAX's transfer server.

Stage 0 runs in a child process (4 simulated CPU devices, tp=2 mesh on devices 0-1) and sends a
scripted set of steps; this pytest process is stage 1 (a tp=2 mesh on its devices 2-3) and
receives them. The two stages exchange addresses through files in a temporary folder.
"""

import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from pipejax.pp_utils import (
    DESCRIPTOR_BYTES,
    TP_AXIS,
    IntermediateSpec,
    IntermediateTensors,
    SpecMismatchError,
    TensorSpec,
    TransferServerTransport,
    TransportTimeout,
    stage_mesh,
    stage_meshes,
)
from pipejax.pp_utils import transfer_transport as tt

pytestmark = pytest.mark.timeout(60)

STEPS = (0, 1, 2, 7, 12345)
MISMATCH_STEP = 100  # stage 0 sends hidden_states of the wrong width
AFTER_MISMATCH = 101  # ... and then a good step again
NEVER_SENT = 999
B, D = 4, 8

# The stage-0 process. Roles: "sender" publishes STEPS and MISMATCH_STEP, then stays alive until
# its stdin closes; "timeout-receiver" receives a step nobody sends and reports how it ended.
STAGE_SCRIPT = r"""
import json, os, sys, time
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from pipejax.pp_utils import IntermediateSpec, IntermediateTensors, TensorSpec, TransferServerTransport
from pipejax.pp_utils import TransportTimeout, stage_mesh

role, workdir, steps, mismatch_step, never_sent, B, D = sys.argv[1:8]
steps, mismatch_step, never_sent, B, D = json.loads(steps), int(mismatch_step), int(never_sent), int(B), int(D)
transport = TransferServerTransport()
with open(os.path.join(workdir, role + ".tmp"), "w") as f:
    f.write(transport.address)
os.rename(os.path.join(workdir, role + ".tmp"), os.path.join(workdir, role + ".addr"))
mesh = stage_mesh(jax.devices()[:2])

if role == "sender":
    for step in steps:
        h = np.arange(B * D, dtype=np.float32).reshape(B, D) + 1000 * step  # [B, D]
        transport.send(step, IntermediateTensors({
            "hidden_states": jax.device_put(h, NamedSharding(mesh, PartitionSpec(None, "tp"))),
            "residual": jax.device_put(-h, NamedSharding(mesh, PartitionSpec())),
            "positions": jnp.full((B,), step, jnp.int32),
        }))
    transport.send(mismatch_step, IntermediateTensors({
        "hidden_states": jnp.zeros((B, D + 1), jnp.float32),
        "residual": jnp.zeros((B, D), jnp.float32),
        "positions": jnp.zeros((B,), jnp.int32),
    }))
    step = mismatch_step + 1
    h = np.arange(B * D, dtype=np.float32).reshape(B, D) + 1000 * step
    transport.send(step, IntermediateTensors({
        "hidden_states": jax.device_put(h, NamedSharding(mesh, PartitionSpec(None, "tp"))),
        "residual": jax.device_put(-h, NamedSharding(mesh, PartitionSpec())),
        "positions": jnp.full((B,), step, jnp.int32),
    }))
    sys.stdin.read()  # serve until the test closes our stdin
else:
    sender = sys.argv[8]
    transport.connect_previous(sender, "stage 0")
    spec = IntermediateSpec({"hidden_states": TensorSpec((B, D), "float32", NamedSharding(mesh, PartitionSpec()))})
    start = time.monotonic()
    try:
        transport.receive(never_sent, spec, timeout=1.0)
        outcome = "received"
    except TransportTimeout as e:
        outcome = str(e)
    print(json.dumps({"outcome": outcome, "seconds": time.monotonic() - start}), flush=True)
"""


def _expected(step: int) -> dict[str, np.ndarray]:
    h = np.arange(B * D, dtype=np.float32).reshape(B, D) + 1000 * step
    return {"hidden_states": h, "residual": -h, "positions": np.full((B,), step, np.int32)}


def _start_stage(role: str, workdir, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    args = [role, str(workdir), json.dumps(STEPS), str(MISMATCH_STEP), str(NEVER_SENT), str(B), str(D), *extra]
    with open(workdir / f"{role}.log", "w") as log:
        return subprocess.Popen(
            [sys.executable, "-c", STAGE_SCRIPT, *args],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )


def _wait_address(proc: subprocess.Popen, workdir, role: str, limit_s: float = 45.0) -> str:
    path = workdir / f"{role}.addr"
    deadline = time.monotonic() + limit_s
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"{role} process did not start:\n{(workdir / f'{role}.log').read_text()[-3000:]}")
        time.sleep(0.05)
    return path.read_text()


@pytest.fixture(scope="module")
def stage0(tmp_path_factory):
    """The address of a live stage-0 process that has sent STEPS and MISMATCH_STEP."""
    workdir = tmp_path_factory.mktemp("stage0")
    proc = _start_stage("sender", workdir)
    try:
        yield _wait_address(proc, workdir, "sender"), workdir
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()


@pytest.fixture(scope="module")
def stage1(stage0):
    """This process as stage 1, connected to stage 0."""
    transport = TransferServerTransport()
    transport.connect_previous(stage0[0], "stage 0")
    yield transport
    transport.close()


def _tp2_spec(hidden_pspec=PartitionSpec(None, TP_AXIS), residual_pspec=PartitionSpec(None, TP_AXIS)):
    """Stage 1's expectation on a tp=2 mesh over this process's devices 2-3."""
    mesh = stage_mesh(jax.devices()[2:4])
    return IntermediateSpec(
        {
            "hidden_states": TensorSpec((B, D), "float32", NamedSharding(mesh, hidden_pspec)),
            "residual": TensorSpec((B, D), "float32", NamedSharding(mesh, residual_pspec)),
            "positions": TensorSpec((B,), "int32", NamedSharding(mesh, PartitionSpec())),
        }
    )


def test_steps_arrive_in_the_receivers_tp2_sharding(stage1):
    spec = _tp2_spec()
    for step in reversed(STEPS):  # any order: each step is its own pull
        got = stage1.receive(step, spec, timeout=20)
        assert list(got) == ["hidden_states", "positions", "residual"]
        for name, want in _expected(step).items():
            assert got[name].sharding == spec.tensors[name].sharding, name
            assert {s.device.id for s in got[name].addressable_shards} == {2, 3}
            np.testing.assert_array_equal(np.asarray(got[name]), want, err_msg=f"step {step} {name}")
    assert stage1.pending() == 0
    with pytest.raises(ValueError, match="already received"):
        stage1.receive(STEPS[0], spec, timeout=1)


def test_spec_mismatch_names_both_shapes(stage1):
    # Earlier steps of this spec were received, so the data pull goes out with the descriptor's,
    # in the expected layout; the descriptor still reports the mismatch, and nothing hangs.
    spec = _tp2_spec()
    start = time.monotonic()
    with pytest.raises(SpecMismatchError) as err:
        stage1.receive(MISMATCH_STEP, spec, timeout=20)
    assert time.monotonic() - start < 5
    message = str(err.value)
    assert f"step {MISMATCH_STEP}" in message and "stage 0" in message
    assert "float32[4, 9]" in message and "float32[4, 8]" in message
    assert stage1.pending() == 0
    got = stage1.receive(AFTER_MISMATCH, spec, timeout=20)  # the transport keeps working
    for name, want in _expected(AFTER_MISMATCH).items():
        assert got[name].sharding == spec.tensors[name].sharding, name
        np.testing.assert_array_equal(np.asarray(got[name]), want, err_msg=name)


def test_receive_of_a_step_never_sent_times_out(stage1):
    start = time.monotonic()
    with pytest.raises(TransportTimeout) as err:
        stage1.receive(NEVER_SENT, _tp2_spec(), timeout=1.0)
    assert time.monotonic() - start < 5
    assert f"step {NEVER_SENT}" in str(err.value) and "stage 0" in str(err.value)
    assert stage1.pending() == 1  # a later receive of that step resumes the same pull


def test_receiver_process_exits_after_a_timeout(stage0):
    """A pull left waiting for a step nobody sends must not keep the receiving process alive."""
    address, workdir = stage0
    proc = _start_stage("timeout-receiver", workdir, address)
    out, _ = proc.communicate(timeout=45)
    assert proc.returncode == 0, (workdir / "timeout-receiver.log").read_text()[-3000:]
    report = json.loads(out.strip().splitlines()[-1])
    assert f"step {NEVER_SENT}" in report["outcome"] and "stage 0" in report["outcome"]
    assert report["seconds"] < 5


@pytest.fixture(scope="module")
def pair():
    """Both ends in this process (two transfer servers), stage 0 on devices 0-3, stage 1 on 4-7."""
    sender, receiver = TransferServerTransport(), TransferServerTransport()
    receiver.connect_previous(sender.address, "stage 0")
    yield sender, receiver, stage_meshes(jax.devices(), 2, 4)
    sender.close()
    receiver.close()


def test_receive_fails_fast_when_the_sender_exits(tmp_path):
    proc = _start_stage("sender", tmp_path)
    receiver = TransferServerTransport()
    receiver.connect_previous(_wait_address(proc, tmp_path, "sender"), "stage 0")
    proc.stdin.close()  # the sender exits
    proc.wait(timeout=20)
    proc.stdout.close()
    start = time.monotonic()
    with pytest.raises(ConnectionError, match=f"step {NEVER_SENT}: .*stage 0"):
        receiver.receive(NEVER_SENT, _tp2_spec(), timeout=20)
    assert time.monotonic() - start < 10
    receiver.close()


class TestWithinOneProcess:
    """The bookkeeping around the pulls, without a second process."""

    def _send(self, sender, step, mesh):
        h = jnp.asarray(_expected(step)["hidden_states"])
        sender.send(
            step,
            IntermediateTensors({"hidden_states": jax.device_put(h, NamedSharding(mesh, PartitionSpec(None, "tp")))}),
        )

    def test_layout_change_and_timeout_resume(self, pair):
        sender, receiver, meshes = pair
        target = NamedSharding(meshes[1], PartitionSpec(TP_AXIS, None))  # split the other way than sent
        spec = IntermediateSpec({"hidden_states": TensorSpec((B, D), "float32", target)})
        with pytest.raises(TransportTimeout):
            receiver.receive(5, spec, timeout=0.2)
        self._send(sender, 5, meshes[0])
        got = receiver.receive(5, spec, timeout=10)["hidden_states"]
        assert got.sharding == target
        np.testing.assert_array_equal(np.asarray(got), _expected(5)["hidden_states"])
        assert receiver.pending() == 0

    def _receive_ok(self, receiver, step, spec, timeout=10):
        got = receiver.receive(step, spec, timeout=timeout)["hidden_states"]
        assert got.sharding == spec.tensors["hidden_states"].sharding
        np.testing.assert_array_equal(np.asarray(got), _expected(step)["hidden_states"], err_msg=f"step {step}")
        assert receiver.pending() == 0

    def _spec(self, mesh, pspec=PartitionSpec(None, TP_AXIS)):
        return IntermediateSpec({"hidden_states": TensorSpec((B, D), "float32", NamedSharding(mesh, pspec))})

    def test_timeout_resume_with_the_data_pull_already_out(self, pair):
        sender, receiver, meshes = pair
        spec = self._spec(meshes[1])
        self._send(sender, 10, meshes[0])
        self._receive_ok(receiver, 10, spec)  # learns the layout: later pulls go out with the descriptor's
        with pytest.raises(TransportTimeout):
            receiver.receive(11, spec, timeout=0.2)
        assert receiver.pending() == 1
        self._send(sender, 11, meshes[0])
        self._receive_ok(receiver, 11, spec)

    def test_spec_mismatch_with_the_data_pull_already_out(self, pair):
        sender, receiver, meshes = pair
        spec = self._spec(meshes[1])
        self._send(sender, 20, meshes[0])
        self._receive_ok(receiver, 20, spec)
        for step, h in ((21, jnp.zeros((B, D + 3), jnp.float32)), (22, jnp.zeros((B, D // 2), jnp.float32))):
            sender.send(step, IntermediateTensors({"hidden_states": h}))  # more bytes, then fewer
            start = time.monotonic()
            with pytest.raises(SpecMismatchError, match=f"step {step}"):
                receiver.receive(step, spec, timeout=10)
            assert time.monotonic() - start < 5
            assert receiver.pending() == 0
        self._send(sender, 23, meshes[0])
        self._receive_ok(receiver, 23, spec)

    def test_a_wait_queries_readiness_sparingly(self, pair, monkeypatch):
        """Each is_ready() leaks native memory in jaxlib 0.10.2: a wait spaces its queries, never one per spin."""
        sender, receiver, meshes = pair
        sleeps = []
        real_sleep = time.sleep
        monkeypatch.setattr(time, "sleep", lambda s: (sleeps.append(s), real_sleep(s)))
        before = receiver.readiness_checks
        with pytest.raises(TransportTimeout):
            receiver.receive(15, self._spec(meshes[1]), timeout=0.3)
        spin_checks = tt._SPIN_S / tt._SPIN_CHECK_S + 1
        assert 0 < receiver.readiness_checks - before <= len(sleeps) + spin_checks + 1
        self._send(sender, 15, meshes[0])
        self._receive_ok(receiver, 15, self._spec(meshes[1]))

    def test_sender_changes_layout_between_steps(self, pair):
        """Same shapes, new sender layout: data pulled in the old layout are put back in place."""
        sender, receiver, meshes = pair
        spec = self._spec(meshes[1], PartitionSpec())  # a spec of its own: layouts are learned per spec
        self._send(sender, 30, meshes[0])
        self._receive_ok(receiver, 30, spec)
        rows = NamedSharding(meshes[0], PartitionSpec(TP_AXIS))  # buffers as large as before: [1, D], not [B, D/4]
        for step in (31, 32):
            h = jax.device_put(jnp.asarray(_expected(step)["hidden_states"]), rows)
            sender.send(step, IntermediateTensors({"hidden_states": h}))
            self._receive_ok(receiver, step, spec)

    def test_sender_changes_buffer_sizes_between_steps(self, pair):
        """Same shapes, buffers of other sizes: that step is lost with a clear error; the next ones arrive."""
        sender, receiver, meshes = pair
        spec = self._spec(meshes[1], PartitionSpec(TP_AXIS, None))
        self._send(sender, 40, meshes[0])
        self._receive_ok(receiver, 40, spec)
        for step in (41, 42):  # now one buffer on one device
            h = jax.device_put(jnp.asarray(_expected(step)["hidden_states"]), jax.devices()[0])
            sender.send(step, IntermediateTensors({"hidden_states": h}))
        with pytest.raises(ValueError, match="step 41: .*changed how it lays out"):
            receiver.receive(41, spec, timeout=10)
        assert receiver.pending() == 0
        self._receive_ok(receiver, 42, spec)

    def test_a_descriptor_that_is_not_ours(self, pair):
        sender, receiver, meshes = pair
        spec = self._spec(meshes[1])
        sender._server.await_pull(2 * 50, [jax.device_put(np.full(DESCRIPTOR_BYTES, 0xFF, np.uint8))])
        with pytest.raises(SpecMismatchError, match="not a pipejax activation"):
            receiver.receive(50, spec, timeout=10)
        self._send(sender, 51, meshes[0])
        self._receive_ok(receiver, 51, spec)

    def test_a_sent_layout_is_described_once(self, pair, monkeypatch):
        sender, receiver, meshes = pair
        spec = self._spec(meshes[1])
        self._send(sender, 60, meshes[0])
        monkeypatch.setattr(tt, "describe_array", lambda a: pytest.fail("described again"))
        self._send(sender, 61, meshes[0])
        for step in (60, 61):
            self._receive_ok(receiver, step, spec)

    def test_a_step_is_sent_once(self, pair):
        sender, _, meshes = pair
        self._send(sender, 6, meshes[0])
        with pytest.raises(ValueError, match="already sent"):
            self._send(sender, 6, meshes[0])
        with pytest.raises(ValueError, match="step_id"):
            self._send(sender, -1, meshes[0])

    def test_a_prefetched_step_is_received_once_from_the_pulls_already_out(self, pair):
        """``prefetch`` (another thread, while the stage runs an earlier step) issues the pulls before the sender
        publishes; the step's ``receive`` then uses them. Prefetching a step again, or one already received,
        issues nothing."""
        sender, receiver, meshes = pair
        spec = self._spec(meshes[1])
        self._send(sender, 70, meshes[0])
        self._receive_ok(receiver, 70, spec)  # the layout is known: a prefetch pulls the data too
        pulls = []
        real_pull = receiver._conn.pull
        receiver._conn = _CountingConnection(real_pull, pulls)
        for step in (71, 72):
            receiver.prefetch(step, spec)
            receiver.prefetch(step, spec)
        assert receiver.pending() == 2 and len(pulls) == 4  # per step: descriptor + data, once
        self._send(sender, 71, meshes[0])
        self._send(sender, 72, meshes[0])
        got = receiver.receive(71, spec, timeout=10)["hidden_states"]
        np.testing.assert_array_equal(np.asarray(got), _expected(71)["hidden_states"])
        self._receive_ok(receiver, 72, spec)
        receiver.prefetch(71, spec)
        assert len(pulls) == 4 and receiver.pending() == 0
        receiver._conn = _CountingConnection.unwrap(receiver._conn)

    def test_prefetch_before_a_connection_does_nothing(self):
        spec = IntermediateSpec({"x": TensorSpec((2,), "float32")})
        transport = TransferServerTransport()
        transport.prefetch(0, spec)
        assert transport.pending() == 0
        transport.close()

    def test_receive_needs_a_connection(self):
        spec = IntermediateSpec({"x": TensorSpec((2,), "float32")})
        with pytest.raises(RuntimeError, match="connect_previous"):
            TransferServerTransport().receive(0, spec, timeout=1)


def test_abort_ends_a_waiting_receive_until_the_previous_stage_is_replaced(pair):
    """The executor replacing a lost previous stage: a receive stuck on it ends at once, later ones fail
    fast, and after ``connect_previous`` to the replacement steps flow again."""
    import threading

    from pipejax.pp_utils import TransportAborted

    _, receiver, meshes = pair
    spec = IntermediateSpec({"hidden_states": TensorSpec((B, D), "float32", NamedSharding(meshes[1], PartitionSpec()))})
    outcome = {}

    def wait_for_never_sent():
        start = time.monotonic()
        try:
            receiver.receive(NEVER_SENT + 1, spec, timeout=30)
        except Exception as e:  # noqa: BLE001 - recorded for the asserts
            outcome["error"], outcome["seconds"] = e, time.monotonic() - start

    waiter = threading.Thread(target=wait_for_never_sent)
    waiter.start()
    time.sleep(0.5)
    receiver.abort_receives()
    waiter.join(timeout=10)
    assert isinstance(outcome.get("error"), TransportAborted) and outcome["seconds"] < 5, outcome
    with pytest.raises(TransportAborted):
        receiver.receive(NEVER_SENT + 2, spec, timeout=30)
    replacement = TransferServerTransport()
    receiver.connect_previous(replacement.address, "stage 0 (replaced)")
    TestWithinOneProcess()._send(replacement, 4242, meshes[0])
    got = receiver.receive(4242, spec, timeout=10)["hidden_states"]
    np.testing.assert_array_equal(np.asarray(got), _expected(4242)["hidden_states"])
    replacement.close()


class _CountingConnection:
    """A transfer connection whose pulls are counted (``pulls``: their uuids)."""

    def __init__(self, pull, pulls: list):
        self._pull, self.pulls = pull, pulls

    def pull(self, uuid, structs):
        self.pulls.append(uuid)
        return self._pull(uuid, structs)

    @staticmethod
    def unwrap(conn):
        return conn._pull.__self__
