"""Every lab hardware profile names a catalog node type, so the lab inventory declares
hosts the planner accepts (gpufleet_hardware)."""

import pytest

from gpufleet import catalog
from gpufleet_lab import hosts as lab_hosts
from gpufleet_lab import hwsim
from gpufleet_lab.hosts import hardware_of
from gpufleet_lab.net import LabError


def test_every_profile_maps_to_its_catalog_hardware():
    expected = {"h200x8": "h200", "h200x2": "h200", "b200x8": "b200", "gb200x4": "gb200",
                "mi355x8": "mi355x"}
    assert {p: hardware_of(p) for p in hwsim.PROFILES} == expected
    assert set(expected.values()) <= set(catalog.load().hardware)


def test_reboot_takes_only_faults_of_how_a_host_boots():
    # refused before the lab is looked at: the hardware faults are made by `up`
    with pytest.raises(LabError, match=r"ib-down: not a fault of how a host boots; "
                                       r"reboot takes no-ipc-lock"):
        lab_hosts.reboot("lab1", boot_faults=["ib-down", "no-ipc-lock"])
    assert set(lab_hosts.BOOT_FAULTS) <= set(hwsim.FAULTS)
