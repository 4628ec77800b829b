"""Integration fixtures: the lab of real systemd hosts (needs root)."""

from __future__ import annotations

import pytest

from gpufleet.lab import hosts as lab_hosts


@pytest.fixture(scope="session")
def lab():
    """Two lab hosts, brought up from scratch for the session and taken down after it.

    Missing prerequisites (not root, systemd-nspawn absent, ...) fail the tests
    with the fix in the message rather than skipping them.
    """
    try:
        lab_hosts.down()
        hosts = lab_hosts.up(hosts=2)
    except lab_hosts.LabError as exc:
        pytest.fail(f"lab: {exc}", pytrace=False)
    yield hosts
    lab_hosts.down()
