"""Integration fixtures: the lab of real systemd hosts (needs root).

The session starts from nothing (a lab left from earlier is taken down) and ends with
the lab down. Each test module gets two hosts without faults: `up()` is idempotent, so
a module that changed the lab (faults, a killed lab) does not leak into the next one.
Missing prerequisites (not root, systemd-nspawn absent, ...) fail the tests with the
fix in the message rather than skipping them.
"""

from __future__ import annotations

import pytest

from gpufleet_lab import hosts as lab_hosts


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
