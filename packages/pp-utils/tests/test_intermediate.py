"""IntermediateTensors as a pytree, its abstract IntermediateSpec, and spec checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from pipejax.pp_utils import (
    TP_AXIS,
    IntermediateSpec,
    IntermediateTensors,
    SpecMismatchError,
    TensorSpec,
    stage_meshes,
)


def _activations(batch=4, hidden=8):
    return IntermediateTensors(
        {
            "residual": jnp.arange(batch * hidden, dtype=jnp.float32).reshape(batch, hidden),  # [B, D]
            "hidden_states": jnp.ones((batch, hidden), jnp.bfloat16),  # [B, D]
            "positions": jnp.arange(batch, dtype=jnp.int32),  # [B]
        }
    )


def _assert_same(a: IntermediateTensors, b: IntermediateTensors):
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        np.testing.assert_array_equal(np.asarray(a[name], np.float32), np.asarray(b[name], np.float32))


# ---- mapping and pytree behaviour --------------------------------------------------------------


def test_mapping_interface_sorted_by_name():
    t = _activations()
    assert list(t) == ["hidden_states", "positions", "residual"]
    assert len(t) == 3
    assert "residual" in t and "logits" not in t
    assert t["positions"].shape == (4,)
    with pytest.raises(KeyError):
        t["logits"]


def test_insertion_order_does_not_matter():
    a = IntermediateTensors({"x": jnp.zeros(2), "a": jnp.ones(3)})
    b = IntermediateTensors({"a": jnp.ones(3), "x": jnp.zeros(2)})
    assert jax.tree.structure(a) == jax.tree.structure(b)
    assert list(a) == list(b) == ["a", "x"]


def test_flatten_unflatten_roundtrip():
    t = _activations()
    leaves, treedef = jax.tree.flatten(t)
    assert len(leaves) == 3
    assert [leaf.shape for leaf in leaves] == [(4, 8), (4,), (4, 8)]  # sorted-name order
    back = jax.tree.unflatten(treedef, leaves)
    assert isinstance(back, IntermediateTensors)
    _assert_same(back, t)


def test_different_names_are_different_treedefs():
    a = IntermediateTensors({"hidden_states": jnp.zeros(2)})
    b = IntermediateTensors({"residual": jnp.zeros(2)})
    assert jax.tree.structure(a) != jax.tree.structure(b)


def test_tree_map():
    t = _activations()
    doubled = jax.tree.map(lambda x: x * 2, t)
    assert isinstance(doubled, IntermediateTensors)
    assert list(doubled) == list(t)
    np.testing.assert_array_equal(doubled["residual"], t["residual"] * 2)
    assert doubled["hidden_states"].dtype == jnp.bfloat16


def test_through_jit():
    traces = []

    @jax.jit
    def stage(x: IntermediateTensors) -> IntermediateTensors:
        traces.append(x)
        h = x["hidden_states"].astype(jnp.float32) + x["residual"]  # [B, D]
        return IntermediateTensors({"hidden_states": h, "residual": x["residual"], "positions": x["positions"] + 1})

    t = _activations()
    out = stage(t)
    assert isinstance(out, IntermediateTensors)
    assert list(out) == ["hidden_states", "positions", "residual"]
    np.testing.assert_array_equal(out["hidden_states"], 1.0 + np.asarray(t["residual"]))
    np.testing.assert_array_equal(out["positions"], np.arange(4) + 1)
    # A second call with the same names, shapes and dtypes reuses the trace.
    stage(_activations())
    assert len(traces) == 1
    assert isinstance(traces[0], IntermediateTensors)


def test_device_put_keeps_the_type():
    t = _activations()
    dev = jax.devices()[3]
    moved = jax.device_put(t, dev)
    assert isinstance(moved, IntermediateTensors)
    assert all(v.devices() == {dev} for v in moved.values())
    _assert_same(moved, t)


def test_repr_shows_names_dtypes_and_shapes():
    assert repr(_activations()) == (
        "IntermediateTensors(hidden_states=bfloat16[4, 8], positions=int32[4], residual=float32[4, 8])"
    )


def test_repr_of_a_non_array_prefix_tree():
    # The same pytree type carries out_shardings / in_axes; printing it must not raise.
    mesh = stage_meshes(jax.devices(), 1, 8)[0]
    shardings = IntermediateTensors({"h": NamedSharding(mesh, PartitionSpec(TP_AXIS)), "p": None})
    text = repr(shardings)
    assert text.startswith("IntermediateTensors(h=NamedSharding(")
    assert text.endswith(", p=None)")
    assert repr(IntermediateTensors({"a": 0, "b": 1.5})) == "IntermediateTensors(a=0, b=1.5)"


def test_as_out_shardings_of_jit():
    mesh = stage_meshes(jax.devices(), 1, 8)[0]
    split, whole = NamedSharding(mesh, PartitionSpec(TP_AXIS)), NamedSharding(mesh, PartitionSpec())
    f = jax.jit(lambda x: x, out_shardings=IntermediateTensors({"a": split, "b": whole}))
    out = f(IntermediateTensors({"a": jnp.zeros(8), "b": jnp.ones(8)}))
    assert out["a"].sharding == split
    assert out["b"].sharding == whole


# ---- spec --------------------------------------------------------------------------------------


def test_spec_shapes_and_dtypes():
    spec = _activations().spec()
    assert spec.names() == ("hidden_states", "positions", "residual")
    assert spec.tensors["hidden_states"] == TensorSpec((4, 8), "bfloat16", None)
    assert spec.tensors["positions"] == TensorSpec((4,), "int32", None)
    assert spec.tensors["residual"] == TensorSpec((4, 8), "float32", None)
    assert spec.describe() == "{hidden_states: bfloat16[4, 8], positions: int32[4], residual: float32[4, 8]}"


def test_spec_from_numpy_arrays():
    t = IntermediateTensors({"h": np.zeros((2, 3), np.float16)})
    assert t.spec().tensors["h"] == TensorSpec((2, 3), "float16")


def test_spec_with_sharding():
    mesh = stage_meshes(jax.devices(), 2, 4)[1]
    row = NamedSharding(mesh, PartitionSpec(None, "tp"))
    spec = _activations().spec({"hidden_states": row, "residual": row})
    assert spec.tensors["hidden_states"].sharding == row
    assert spec.tensors["residual"].sharding == row
    assert spec.tensors["positions"].sharding is None  # not named -> no target sharding


def test_shape_dtype_struct():
    mesh = stage_meshes(jax.devices(), 1, 8)[0]
    sharding = NamedSharding(mesh, PartitionSpec("tp"))
    struct = TensorSpec((8, 2), "bfloat16", sharding).shape_dtype_struct()
    assert struct.shape == (8, 2)
    assert struct.dtype == jnp.bfloat16
    assert struct.sharding == sharding
    # It is usable as an abstract input to tracing.
    out = jax.eval_shape(lambda x: x.sum(axis=1), struct)
    assert out.shape == (8,)


def test_spec_sorts_names_and_is_frozen():
    spec = IntermediateSpec({"b": TensorSpec((1,), "int8"), "a": TensorSpec((2,), "int8")})
    assert spec.names() == ("a", "b")
    with pytest.raises(AttributeError):
        spec.tensors = {}


def test_nbytes():
    # bf16 [4, 8] = 64 B, int32 [4] = 16 B, f32 [4, 8] = 128 B
    assert _activations().spec().nbytes() == 64 + 16 + 128
    assert IntermediateSpec({"scalar": TensorSpec((), "float64")}).nbytes() == 8
    assert IntermediateSpec({"empty": TensorSpec((0, 5), "float32")}).nbytes() == 0
    assert IntermediateSpec({}).nbytes() == 0


# ---- check -------------------------------------------------------------------------------------


def test_check_accepts_matching_tensors_regardless_of_sharding():
    mesh = stage_meshes(jax.devices(), 2, 4)[1]
    spec = _activations().spec({"residual": NamedSharding(mesh, PartitionSpec())})
    spec.check(_activations(), step_id=3, peer="stage 0")  # no error


def _check_message(spec: IntermediateSpec, got: IntermediateTensors, step_id=7, peer="stage 0 (10.0.0.1)") -> str:
    with pytest.raises(SpecMismatchError) as err:
        spec.check(got, step_id=step_id, peer=peer)
    assert isinstance(err.value, ValueError)  # callers may catch ValueError
    msg = str(err.value)
    assert f"step {step_id}" in msg
    assert peer in msg
    assert "same model config and batch bucket" in msg  # the fix
    return msg


def test_check_names_mismatch():
    spec = _activations().spec()
    got = IntermediateTensors({"hidden_states": jnp.ones((4, 8), jnp.bfloat16)})
    msg = _check_message(spec, got)
    assert "are {hidden_states: bfloat16[4, 8]}" in msg
    assert "expects {hidden_states: bfloat16[4, 8], positions: int32[4], residual: float32[4, 8]}" in msg


def test_check_extra_name():
    spec = IntermediateTensors({"h": jnp.zeros(2)}).spec()
    msg = _check_message(spec, IntermediateTensors({"h": jnp.zeros(2), "extra": jnp.zeros(1)}))
    assert "extra: float32[1]" in msg


def test_check_shape_mismatch():
    spec = _activations(batch=4).spec()
    msg = _check_message(spec, _activations(batch=16), step_id=42)
    assert "residual: float32[16, 8]" in msg  # what arrived
    assert "residual: float32[4, 8]" in msg  # what was expected


def test_check_dtype_mismatch():
    spec = IntermediateTensors({"hidden_states": jnp.zeros((2, 4), jnp.float32)}).spec()
    got = IntermediateTensors({"hidden_states": jnp.zeros((2, 4), jnp.bfloat16)})
    msg = _check_message(spec, got, peer="peer-x")
    assert "are {hidden_states: bfloat16[2, 4]}" in msg
    assert "expects {hidden_states: float32[2, 4]}" in msg
