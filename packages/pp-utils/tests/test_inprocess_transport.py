"""InProcessTransport: stage-to-stage activations within one process, keyed by step id."""

import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from pipejax.pp_utils import (
    TP_AXIS,
    ActivationTransport,
    InProcessTransport,
    IntermediateTensors,
    SpecMismatchError,
    TransportTimeout,
    place,
    stage_meshes,
)

pytestmark = pytest.mark.timeout(20)


@pytest.fixture(scope="module")
def meshes():
    return stage_meshes(jax.devices(), 2, 4)  # stage 0: devices 0-3, stage 1: devices 4-7


def _activations(step: int, meshes) -> IntermediateTensors:
    """What stage 0 produces: laid out on stage 0's mesh, values depending on the step."""
    sharded = NamedSharding(meshes[0], PartitionSpec(None, TP_AXIS))
    h = jnp.arange(4 * 8, dtype=jnp.float32).reshape(4, 8) + 1000 * step  # [B, D]
    return IntermediateTensors(
        {
            "hidden_states": jax.device_put(h, sharded),
            "residual": jax.device_put(-h, NamedSharding(meshes[0], PartitionSpec())),
            "positions": jnp.full((4,), step, jnp.int32),
        }
    )


def _receiver_spec(meshes):
    """What stage 1 expects: stage 1's mesh, hidden states split the other way."""
    stage1 = meshes[1]
    return _activations(0, meshes).spec(
        {
            "hidden_states": NamedSharding(stage1, PartitionSpec(TP_AXIS, None)),
            "residual": NamedSharding(stage1, PartitionSpec(None, TP_AXIS)),
            "positions": NamedSharding(stage1, PartitionSpec()),
        }
    )


def _assert_values(got: IntermediateTensors, want: IntermediateTensors):
    assert list(got) == list(want)
    for name in want:
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]), err_msg=name)


def test_is_an_activation_transport_and_close_drops_what_was_never_received():
    t = InProcessTransport()
    assert isinstance(t, ActivationTransport)
    t.send(3, IntermediateTensors({"hidden_states": np.zeros((2, 4), np.float32)}))
    assert t.pending() == 1
    t.close()
    assert t.pending() == 0
    t.close()  # idempotent


def test_send_receive_lands_in_the_target_sharding(meshes):
    transport = InProcessTransport(peer="stage 0")
    spec = _receiver_spec(meshes)
    sent = _activations(1, meshes)
    transport.send(1, sent)
    got = transport.receive(1, spec, timeout=5)

    assert isinstance(got, IntermediateTensors)
    _assert_values(got, sent)
    stage1_devices = set(meshes[1].devices.tolist())
    for name, tensor_spec in spec.tensors.items():
        assert got[name].sharding == tensor_spec.sharding, name
        assert got[name].devices() == stage1_devices, name
        assert got[name].dtype == np.dtype(tensor_spec.dtype)
    # [4, 8] split 4-ways on rows -> [1, 8] per device
    assert {s.data.shape for s in got["hidden_states"].addressable_shards} == {(1, 8)}
    assert {s.data.shape for s in got["residual"].addressable_shards} == {(4, 2)}
    assert transport.pending() == 0


def test_receive_without_target_sharding_keeps_arrays(meshes):
    transport = InProcessTransport()
    sent = _activations(0, meshes)
    transport.send(0, sent)
    got = transport.receive(0, sent.spec(), timeout=5)
    for name in sent:
        assert got[name] is sent[name]


def test_place(meshes):
    spec = _receiver_spec(meshes)
    placed = place(_activations(2, meshes), spec)
    assert all(placed[k].sharding == spec.tensors[k].sharding for k in spec.names())
    _assert_values(placed, _activations(2, meshes))


def test_out_of_order_step_ids(meshes):
    transport = InProcessTransport()
    spec = _receiver_spec(meshes)
    for step in (5, 3, 9, 4):
        transport.send(step, _activations(step, meshes))
    assert transport.pending() == 4
    for step in (9, 3, 4, 5):
        got = transport.receive(step, spec, timeout=5)
        _assert_values(got, _activations(step, meshes))
        np.testing.assert_array_equal(got["positions"], np.full(4, step))
    assert transport.pending() == 0


def test_receive_waits_for_a_later_send_from_another_thread(meshes):
    transport = InProcessTransport()
    spec = _receiver_spec(meshes)
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(transport.receive, 7, spec, timeout=10)
        time.sleep(0.2)
        assert not future.done(), "receive returned before anything was sent"
        transport.send(6, _activations(6, meshes))  # another step wakes it, but it keeps waiting
        time.sleep(0.1)
        assert not future.done(), "receive took a step it did not ask for"
        transport.send(7, _activations(7, meshes))
        got = future.result(timeout=5)  # re-raises the receiver's exception, if any
    _assert_values(got, _activations(7, meshes))
    assert transport.pending() == 1  # step 6 is still waiting for its receiver


def test_many_steps_across_threads(meshes):
    transport = InProcessTransport()
    spec = _receiver_spec(meshes)
    steps = list(range(8))

    def receive_all():
        return [transport.receive(step, spec, timeout=10) for step in steps]

    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(receive_all)
        for step in reversed(steps):
            transport.send(step, _activations(step, meshes))
        received = future.result(timeout=10)
    for step, got in zip(steps, received, strict=True):
        np.testing.assert_array_equal(got["positions"], np.full(4, step))


def test_timeout_is_quick_and_names_step_and_peer(meshes):
    transport = InProcessTransport(peer="stage 0 on 10.0.0.3")
    transport.send(1, _activations(1, meshes))
    start = time.monotonic()
    with pytest.raises(TransportTimeout) as err:
        transport.receive(2, _receiver_spec(meshes), timeout=0.2)
    elapsed = time.monotonic() - start
    assert 0.15 <= elapsed < 2.0
    assert isinstance(err.value, TimeoutError)
    msg = str(err.value)
    assert "step 2" in msg
    assert "stage 0 on 10.0.0.3" in msg
    assert "0.2s" in msg
    assert "same step ids" in msg
    assert transport.pending() == 1  # the unrelated step is untouched


def test_zero_timeout_raises_at_once(meshes):
    transport = InProcessTransport()
    start = time.monotonic()
    with pytest.raises(TransportTimeout, match="step 0: no activations from previous stage"):
        transport.receive(0, _receiver_spec(meshes), timeout=0)
    assert time.monotonic() - start < 1.0


def test_duplicate_send(meshes):
    transport = InProcessTransport(peer="stage 1")
    transport.send(4, _activations(4, meshes))
    with pytest.raises(ValueError) as err:
        transport.send(4, _activations(4, meshes))
    msg = str(err.value)
    assert "step 4" in msg
    assert "stage 1" in msg
    assert "must be unique" in msg
    assert transport.pending() == 1


def test_step_id_can_be_reused_after_receive(meshes):
    transport = InProcessTransport()
    spec = _receiver_spec(meshes)
    transport.send(0, _activations(0, meshes))
    transport.receive(0, spec, timeout=5)
    transport.send(0, _activations(1, meshes))
    np.testing.assert_array_equal(transport.receive(0, spec, timeout=5)["positions"], np.full(4, 1))


def test_spec_mismatch(meshes):
    transport = InProcessTransport(peer="stage 0")
    spec = _receiver_spec(meshes)
    wrong = IntermediateTensors({**_activations(3, meshes), "positions": jnp.zeros((8,), jnp.int32)})
    transport.send(3, wrong)
    with pytest.raises(SpecMismatchError) as err:
        transport.receive(3, spec, timeout=5)
    msg = str(err.value)
    assert "step 3" in msg
    assert "from stage 0" in msg
    assert "positions: int32[8]" in msg
    assert "positions: int32[4]" in msg
