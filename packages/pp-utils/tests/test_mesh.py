"""Stage meshes over disjoint devices, and logical-axis sharding rules."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from pipejax.pp_utils import (
    TP_AXIS,
    ShardingRules,
    logical_sharding,
    logical_to_pspec,
    stage_devices,
    stage_mesh,
    stage_meshes,
)

RULES = ShardingRules({"embed": None, "heads": TP_AXIS, "mlp": TP_AXIS, "vocab": TP_AXIS, "batch": None})


def test_eight_simulated_devices():
    assert len(jax.devices()) == 8, "conftest should force 8 CPU devices"


# ---- stage meshes ------------------------------------------------------------------------------


@pytest.mark.parametrize(("pp", "tp"), [(1, 8), (2, 4), (4, 2), (8, 1)])
def test_stage_meshes_disjoint_and_shaped(pp, tp):
    devices = jax.devices()
    meshes = stage_meshes(devices, pp, tp)
    assert len(meshes) == pp
    seen = []
    for rank, mesh in enumerate(meshes):
        assert mesh.axis_names == (TP_AXIS,)
        assert mesh.shape == {TP_AXIS: tp}
        assert mesh.devices.shape == (tp,)
        # Stage `rank` owns devices [rank*tp, (rank+1)*tp) in the given order.
        assert list(mesh.devices) == devices[rank * tp : (rank + 1) * tp]
        seen.extend(mesh.devices.tolist())
    assert len(set(seen)) == len(seen) == pp * tp  # disjoint, and all used


def test_stage_devices_uses_only_what_it_needs():
    groups = stage_devices(jax.devices(), 3, 2)
    assert [[d.id for d in g] for g in groups] == [[0, 1], [2, 3], [4, 5]]


def test_stage_devices_keeps_the_given_order():
    devices = list(reversed(jax.devices()))
    groups = stage_devices(devices, 2, 4)
    assert [[d.id for d in g] for g in groups] == [[7, 6, 5, 4], [3, 2, 1, 0]]


def test_stage_mesh_single_device():
    mesh = stage_mesh([jax.devices()[5]])
    assert mesh.shape == {TP_AXIS: 1}
    assert mesh.devices.tolist() == [jax.devices()[5]]


@pytest.mark.parametrize(("pp", "tp"), [(3, 3), (2, 8), (16, 1)])
def test_too_few_devices(pp, tp):
    with pytest.raises(ValueError) as err:
        stage_meshes(jax.devices(), pp, tp)
    msg = str(err.value)
    assert f"pp_size={pp} x tp_size={tp} needs {pp * tp} devices but only 8 exist" in msg
    assert ", ".join(f"cpu:{i}" for i in range(8)) in msg  # lists the devices it saw
    assert "lower pp/tp" in msg
    assert f"--xla_force_host_platform_device_count={pp * tp}" in msg  # the fix, with the number


def test_no_devices_at_all():
    with pytest.raises(ValueError, match=r"only 0 exist \(none\)"):
        stage_devices([], 1, 1)


@pytest.mark.parametrize(("pp", "tp"), [(0, 1), (1, 0), (-1, 2)])
def test_sizes_must_be_positive(pp, tp):
    with pytest.raises(ValueError, match=rf"pp_size={pp} and tp_size={tp} must both be >= 1"):
        stage_devices(jax.devices(), pp, tp)


# ---- logical axes -> PartitionSpec -------------------------------------------------------------


@pytest.mark.parametrize(
    ("logical", "expected"),
    [
        (("embed", "heads", None), PartitionSpec(None, TP_AXIS, None)),
        (("embed", "mlp"), PartitionSpec(None, TP_AXIS)),
        (("vocab", "embed"), PartitionSpec(TP_AXIS, None)),
        (("batch", "embed"), PartitionSpec(None, None)),  # explicitly replicated
        (("layers", "embed", "head_dim"), PartitionSpec(None, None, None)),  # unknown -> replicated
        ((None, None), PartitionSpec(None, None)),
        ((), PartitionSpec()),
    ],
)
def test_logical_to_pspec(logical, expected):
    assert logical_to_pspec(logical, RULES) == expected


def test_mesh_axis():
    assert RULES.mesh_axis("heads") == TP_AXIS
    assert RULES.mesh_axis("embed") is None
    assert RULES.mesh_axis("not-a-rule") is None
    assert RULES.mesh_axis(None) is None


def test_rules_are_copied_and_frozen():
    source = {"heads": TP_AXIS}
    rules = ShardingRules(source)
    source["embed"] = TP_AXIS
    assert rules.mesh_axis("embed") is None
    with pytest.raises(AttributeError):
        rules.rules = {}


def test_collision_names_both_axes_and_the_fix():
    with pytest.raises(ValueError) as err:
        logical_to_pspec(("heads", "embed", "mlp"), RULES)
    msg = str(err.value)
    assert "'heads' and 'mlp'" in msg
    assert "('heads', 'embed', 'mlp')" in msg
    assert "mesh axis 'tp'" in msg
    assert "map one of them to None" in msg


def test_same_logical_axis_twice_collides():
    with pytest.raises(ValueError, match=r"'heads' and 'heads'"):
        logical_to_pspec(("heads", "heads"), RULES)


def test_other_mesh_axes_do_not_collide():
    rules = ShardingRules({"batch": "dp", "heads": TP_AXIS})
    assert logical_to_pspec(("batch", "heads"), rules) == PartitionSpec("dp", TP_AXIS)


# ---- logical sharding on a real stage mesh -----------------------------------------------------


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_logical_sharding_shards_an_array(tp):
    mesh = stage_meshes(jax.devices(), 8 // tp, tp)[-1]  # the last stage, not device 0
    sharding = logical_sharding(mesh, ("embed", "heads"), RULES)
    assert sharding == NamedSharding(mesh, PartitionSpec(None, TP_AXIS))

    x = np.arange(16 * 8 * 3, dtype=np.float32).reshape(16, 24)  # [embed, heads]
    arr = jax.device_put(x, sharding)
    assert arr.sharding == sharding
    shards = arr.addressable_shards
    assert len(shards) == tp
    assert {s.device for s in shards} == set(mesh.devices.tolist())
    assert all(s.data.shape == (16, 24 // tp) for s in shards)
    # Shard i holds columns [i*w, (i+1)*w), and together they are the whole array.
    width = 24 // tp
    for s in shards:
        col = s.index[1]
        np.testing.assert_array_equal(np.asarray(s.data), x[:, col])
        assert col.stop - col.start == width
    np.testing.assert_array_equal(np.asarray(arr), x)


def test_logical_sharding_replicates_unknown_axes():
    mesh = stage_meshes(jax.devices(), 2, 4)[0]
    sharding = logical_sharding(mesh, ("embed", "unknown"), RULES)
    arr = jax.device_put(jnp.ones((4, 6)), sharding)
    assert len(arr.addressable_shards) == 4
    assert all(s.data.shape == (4, 6) for s in arr.addressable_shards)
    assert sharding.is_fully_replicated


def test_logical_sharding_collision_raises():
    mesh = stage_meshes(jax.devices(), 1, 8)[0]
    with pytest.raises(ValueError, match="both map to mesh axis 'tp'"):
        logical_sharding(mesh, ("heads", "mlp"), RULES)
