"""Every lab hardware profile names a catalog node type, so the lab inventory declares
hosts the planner accepts (gpufleet_hardware)."""

from gpufleet import catalog
from gpufleet_lab import hwsim
from gpufleet_lab.hosts import hardware_of


def test_every_profile_maps_to_its_catalog_hardware():
    expected = {"h200x8": "h200", "h200x2": "h200", "b200x8": "b200", "gb200x4": "gb200",
                "mi355x8": "mi355x"}
    assert {p: hardware_of(p) for p in hwsim.PROFILES} == expected
    assert set(expected.values()) <= set(catalog.load().hardware)
