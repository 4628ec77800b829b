"""Integration fixtures: the lab of real systemd hosts (needs root).

The session starts from nothing (a lab left from earlier is taken down) and ends with
the lab down. Each test module gets two hosts without faults: `up()` is idempotent, so
a module that changed the lab (faults, a killed lab) does not leak into the next one.
Missing prerequisites (not root, systemd-nspawn absent, ...) fail the tests with the
fix in the message rather than skipping them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gpufleet_lab import hosts as lab_hosts

# The modules' order. The lab stays up between modules with what the last one left, so the
# modules that deploy h200-pd-1node with the inventory's settings and leave it serving run
# one after the other: the first deploys (security's, verbose, so that its key check
# reads a first deploy's output), the next ones' deploys are re-runs that change nothing.
# Then the modules that deploy other targets, rebuild the lab with faults or take it down.
# Modules not named run last, in name order.
ORDER = ("test_a_fresh_machine", "test_security", "test_monitoring_lab", "test_bad_inputs",
         "test_drift", "test_dry_parse_lab", "test_faults_serving", "test_acceptance",
         "test_deploy", "test_scale_out", "test_cache_lab", "test_firewall", "test_faults_deploy",
         "test_prepare", "test_prepare_faults", "test_prepare_profiles", "test_lab_hosts",
         "test_image_runtime")


def pytest_collection_modifyitems(items):
    here = Path(__file__).parent
    rank = {name: i for i, name in enumerate(ORDER)}

    def key(item):
        path = Path(str(item.fspath))
        if path.parent != here:
            return (0, 0)  # other directories' tests keep their place, first
        return (1, rank.get(path.stem, len(ORDER)))

    items.sort(key=key)  # stable: a module's tests keep their order


@pytest.fixture(scope="session")
def _lab_session():
    try:
        lab_hosts.down()
    except lab_hosts.LabError as exc:
        pytest.fail(f"lab: {exc}", pytrace=False)
    yield
    lab_hosts.down()


@pytest.fixture(scope="module")
def lab(_lab_session):
    """Two lab hosts (lab1, lab2), profile h200x8, no faults."""
    try:
        return lab_hosts.up(hosts=2)
    except lab_hosts.LabError as exc:
        pytest.fail(f"lab: {exc}", pytrace=False)
