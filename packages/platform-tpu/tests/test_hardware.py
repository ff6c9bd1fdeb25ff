"""TPU generations, accelerator types, and detection from fake /sys and /dev trees and environments."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipejax.platform_tpu import hardware
from pipejax.platform_tpu.hardware import (
    Hardware,
    TpuNotFoundError,
    cpu_hardware,
    detect_tpu_hardware,
    generation,
    parse_accelerator_type,
    probe_device_files,
    resolve_mode,
    tpu_present,
    with_host_device_count,
)


@pytest.mark.parametrize(
    "name, expected, cores",
    [
        ("TPU v2", "v2", 2),
        ("TPU v3", "v3", 2),
        ("TPU v4", "v4", 1),
        ("TPU v5 lite", "v5e", 1),
        ("TPU v5", "v5p", 1),
        ("TPU v5p", "v5p", 1),
        ("TPU v6 lite", "v6e", 1),
        ("TPU7x", "v7x", 2),
        ("v5litepod", "v5e", 1),
        ("tpu-v6e", "v6e", 1),
    ],
)
def test_generation_names_and_cores_per_chip(name, expected, cores):
    gen = generation(name)
    assert (gen.name, gen.cores_per_chip) == (expected, cores)


@pytest.mark.parametrize(
    "accelerator_type, gen, chips",
    [("v2-8", "v2", 4), ("v3-32", "v3", 16), ("v4-8", "v4", 4), ("v4-16", "v4", 8), ("v5p-8", "v5p", 4),
     ("v5litepod-1", "v5e", 1), ("v5litepod-8", "v5e", 8), ("v6e-16", "v6e", 16), ("tpu7x-8", "v7x", 4)],
)
def test_parse_accelerator_type(accelerator_type, gen, chips):
    g, n = parse_accelerator_type(accelerator_type)
    assert (g.name, n) == (gen, chips)


@pytest.mark.parametrize("bad", ["v9-8", "v4", "v4-x", "gpu-8"])
def test_parse_accelerator_type_rejects(bad):
    with pytest.raises(ValueError, match="accelerator type|unknown TPU generation"):
        parse_accelerator_type(bad)


def fake_pci(root: Path, device: str, count: int, subsystem: str = "0x0000") -> str:
    for i in range(count):
        d = root / "bus" / "pci" / "devices" / f"0000:00:0{i}.0"
        d.mkdir(parents=True)
        (d / "vendor").write_text("0x1ae0\n")
        (d / "device").write_text(device + "\n")
        (d / "subsystem_device").write_text(subsystem + "\n")
    other = root / "bus" / "pci" / "devices" / "0000:00:1f.0"
    other.mkdir(parents=True)
    (other / "vendor").write_text("0x8086\n")
    return str(root)


def fake_dev(root: Path, accel: int = 0, vfio: int = 0, sys_root: Path | None = None) -> str:
    """``/dev`` with TPU device files; VFIO groups get a Google device in ``sys_root``'s IOMMU groups."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(accel):
        (root / f"accel{i}").write_text("")
    if vfio:
        (root / "vfio").mkdir()
        (root / "vfio" / "vfio").write_text("")  # the container device, not a chip
        for i, vendor in [(i, "0x1ae0") for i in range(vfio)] + [(96, "0x15b3")]:  # 96: a NIC, not a TPU
            (root / "vfio" / str(i)).write_text("")
            device = sys_root / "kernel" / "iommu_groups" / str(i) / "devices" / f"0000:00:{i:02x}.0"
            device.mkdir(parents=True)
            (device / "vendor").write_text(vendor + "\n")
    return str(root)


def test_detect_from_pci_ids(tmp_path):
    sys_root = fake_pci(tmp_path / "sys", "0x0063", 8)
    hw = detect_tpu_hardware({}, sys_root=sys_root, dev_root=fake_dev(tmp_path / "dev"), jax_fallback=False)
    assert hw == Hardware("tpu", 1, 8, 1, "v5e")
    v3 = detect_tpu_hardware({}, sys_root=fake_pci(tmp_path / "sys3", "0x0027", 4, "0x004f"),
                             dev_root=str(tmp_path / "none"), jax_fallback=False)
    assert (v3.generation, v3.chips_per_host, v3.devices_per_host) == ("v3", 4, 8)


def test_detect_from_environment_and_device_files(tmp_path):
    env = {"TPU_ACCELERATOR_TYPE": "v4-16", "TPU_WORKER_HOSTNAMES": "10.0.0.2,10.0.0.3"}
    hw = detect_tpu_hardware(env, sys_root=str(tmp_path / "sys"), dev_root=fake_dev(tmp_path / "dev", accel=4),
                             jax_fallback=False)
    assert hw == Hardware("tpu", 2, 4, 1, "v4", ("10.0.0.2", "10.0.0.3"))
    # No local probe at all (a driver pod without chips): a multi-host v5e slice is 4-chip hosts.
    hw = detect_tpu_hardware({"TPU_ACCELERATOR_TYPE": "v5litepod-16"}, sys_root=str(tmp_path / "sys"),
                             dev_root=str(tmp_path / "none"), jax_fallback=False)
    assert (hw.num_hosts, hw.chips_per_host) == (4, 4)
    dev = fake_dev(tmp_path / "dev6", vfio=8, sys_root=tmp_path / "sys6")
    hw = detect_tpu_hardware({"TPU_ACCELERATOR_TYPE": "v6e-8"}, sys_root=str(tmp_path / "sys6"), dev_root=dev,
                             jax_fallback=False, num_hosts=3)
    assert (hw.generation, hw.num_hosts, hw.chips_per_host) == ("v6e", 3, 8)


def test_vfio_groups_count_only_google_devices(tmp_path):
    dev = fake_dev(tmp_path / "dev", vfio=4, sys_root=tmp_path / "sys")
    assert probe_device_files(dev, str(tmp_path / "sys")) == 4
    assert probe_device_files(dev, str(tmp_path / "no-sys")) == 0  # cannot tell: not a TPU
    (tmp_path / "gpu" / "vfio").mkdir(parents=True)
    (tmp_path / "gpu" / "vfio" / "96").write_text("")
    assert not tpu_present({}, sys_root=str(tmp_path / "sys"), dev_root=str(tmp_path / "gpu"))


def test_detect_falls_back_to_jax_then_fails_clearly(tmp_path, monkeypatch):
    roots = {"sys_root": str(tmp_path / "sys"), "dev_root": str(tmp_path / "dev")}
    monkeypatch.setattr(hardware, "_jax_tpu_devices", lambda: ("TPU v5 lite", 4))
    assert detect_tpu_hardware({}, **roots) == Hardware("tpu", 1, 4, 1, "v5e")

    def no_tpu():
        raise RuntimeError("Unable to initialize backend 'tpu'")

    monkeypatch.setattr(hardware, "_jax_tpu_devices", no_tpu)
    with pytest.raises(TpuNotFoundError, match="no TPU found.*Unable to initialize backend.*PIPEJAX_PLATFORM=cpu"):
        detect_tpu_hardware({}, **roots)


def test_tpu_present_and_mode(tmp_path):
    roots = {"sys_root": str(tmp_path / "sys"), "dev_root": str(tmp_path / "dev")}
    assert not tpu_present({}, **roots)
    assert tpu_present({"TPU_ACCELERATOR_TYPE": "v5litepod-4"}, **roots)
    assert tpu_present({}, sys_root=roots["sys_root"], dev_root=fake_dev(tmp_path / "dev1", accel=1))
    assert resolve_mode(None, {}, **roots) == "cpu"
    assert resolve_mode(None, {"PIPEJAX_PLATFORM": "TPU"}, **roots) == "tpu"
    assert resolve_mode("cpu", {"PIPEJAX_PLATFORM": "tpu"}, **roots) == "cpu"  # config beats environment
    assert resolve_mode(None, {"TPU_ACCELERATOR_TYPE": "v4-8"}, **roots) == "tpu"
    with pytest.raises(ValueError, match="PIPEJAX_PLATFORM='gpu' is not a platform mode"):
        resolve_mode(None, {"PIPEJAX_PLATFORM": "gpu"}, **roots)


def test_cpu_hardware_and_xla_flags():
    assert cpu_hardware({}).devices_per_host == 8
    assert cpu_hardware({"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}, num_hosts=2) == Hardware(
        "cpu", 2, 4
    )
    assert with_host_device_count("", 2) == "--xla_force_host_platform_device_count=2"
    assert with_host_device_count("--a=1 --xla_force_host_platform_device_count=8 --b", 3) == (
        "--a=1 --b --xla_force_host_platform_device_count=3"
    )
    with pytest.raises(ValueError, match="chips_per_host=0"):
        Hardware("cpu", chips_per_host=0)


def test_hardware_takes_cores_per_chip_from_the_generation():
    assert Hardware("tpu", chips_per_host=4, generation="v3").devices_per_host == 8
    assert Hardware("tpu", generation="v5e").cores_per_chip == 1
    with pytest.raises(ValueError, match="a TPU v7x chip shows 2 devices"):
        Hardware("tpu", chips_per_host=4, cores_per_chip=1, generation="v7x")
    with pytest.raises(ValueError, match="generation='v9'"):
        Hardware("tpu", generation="v9")
