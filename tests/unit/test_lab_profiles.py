"""Every lab hardware profile names a catalog node type, so the lab inventory declares
hosts the planner accepts (gpufleet_hardware)."""

import pytest

from gpufleet import catalog
from gpufleet.module_utils.gpu_facts import GFX_ARCH
from gpufleet.module_utils.preflight import MEMORY_TOLERANCE, version_tuple
from gpufleet_lab import hosts as lab_hosts
from gpufleet_lab import hwsim
from gpufleet_lab.hosts import hardware_of
from gpufleet_lab.net import LabError


def test_every_profile_maps_to_its_catalog_hardware():
    expected = {"h200x8": "h200", "h200x2": "h200", "b200x8": "b200", "b300x8": "b300",
                "gb200x4": "gb200", "gb300x4": "gb300", "mi300x8": "mi300x", "mi325x8": "mi325x",
                "mi355x8": "mi355x"}
    assert {p: hardware_of(p) for p in hwsim.PROFILES} == expected
    # and every catalog hardware has one: --slow deploys every target on its hardware's
    # profile (tests/integration/test_shapes.py)
    assert set(expected.values()) == set(catalog.load().hardware)


def test_reboot_takes_only_faults_of_how_a_host_boots():
    # refused before the lab is looked at: the hardware faults are made by `up`
    with pytest.raises(LabError, match=r"ib-down: not a fault of how a host boots; "
                                       r"reboot takes no-ipc-lock"):
        lab_hosts.reboot("lab1", boot_faults=["ib-down", "no-ipc-lock"])
    assert set(lab_hosts.BOOT_FAULTS) <= set(hwsim.FAULTS)


# Where a profile may differ from its catalog entry: a 2x H200 virtual machine is a slice of
# an 8-GPU node whose fabric manager belongs to the hypervisor.
VM_SLICES = {"h200x2"}


@pytest.mark.parametrize("profile", sorted(hwsim.PROFILES))
def test_profile_agrees_with_its_catalog_hardware(profile):
    spec, hw = hwsim.PROFILES[profile], catalog.load().hardware[hardware_of(profile)]
    gpu = spec["gpu"]
    assert (spec["vendor"], spec["cpu_arch"]) == (hw.vendor, hw.cpu_arch)
    assert hw.product in gpu["name"]
    if profile not in VM_SLICES:
        assert len(spec["bus_ids"]) == hw.gpus_per_node
    if spec["vendor"] == "nvidia":
        assert (gpu["architecture"].lower(), gpu["compute_cap"]) == (hw.arch,
                                                                     hw.compute_capability)
        assert version_tuple(spec["driver"]["version"]) >= version_tuple(hw.driver_floor)
        assert bool(spec["imex"]) == ("imex" in hw.host_software)
        if profile not in VM_SLICES:
            fm = spec["fabric_manager"] or {}
            assert bool(fm) == ("fabric_manager" in hw.host_software)
            assert bool(fm.get("nvlsm")) == ("nvlsm" in hw.host_software)
            assert bool(spec.get("nvswitches")) == (hw.interconnect == "nvswitch")
    else:
        assert (gpu["gfx_target"], GFX_ARCH[gpu["gfx_target"]]) == (hw.gfx, hw.arch)
        assert version_tuple(spec["rocm"]["version"]) >= version_tuple(hw.rocm_floor)


@pytest.mark.parametrize("profile", sorted(hwsim.PROFILES))
def test_profile_memory_fits_its_catalog_figure(profile):
    hw = catalog.load().hardware[hardware_of(profile)]
    assert hwsim.PROFILES[profile]["gpu"]["memory_mib"] >= hw.memory_mib * MEMORY_TOLERANCE
