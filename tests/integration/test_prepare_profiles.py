"""Host preparation converges on every lab hardware profile, and re-runs with changed=0.

(h200x8 is covered in depth by test_prepare.py; the others here: Blackwell HGX with the
NVLink subnet manager, a GB200 tray with IMEX, an MI355X node with ROCm.)
"""

from __future__ import annotations

import pytest
from labutil import playbook, recap

from gpufleet.lab import hosts as lab_hosts

pytestmark = pytest.mark.lab

PROFILES = [
    ("b200x8", "b200-pd-1node"),
    ("gb200x4", "gb200-agg"),
    ("mi355x8", "sglang-mi355x-low-latency"),
]


@pytest.fixture(params=PROFILES, ids=[p for p, _ in PROFILES])
def profile_lab(request, _lab_session):
    profile, target = request.param
    lab_hosts.up(hosts=2, profiles=[profile])
    yield target
    lab_hosts.up(hosts=2)


def test_prepare_converges_and_reruns_unchanged(profile_lab):
    args = ("-i", "inventories/lab", "playbooks/preflight.yml", "playbooks/prepare.yml",
            "-e", f"gpufleet_target={profile_lab}")
    first = playbook(*args)
    assert first.returncode == 0, first.stdout[-4000:]
    again = playbook(*args)
    assert again.returncode == 0, again.stdout[-4000:]
    assert all(c["changed"] == 0 for h, c in recap(again.stdout).items() if h != "localhost"), \
        again.stdout[-3000:]
