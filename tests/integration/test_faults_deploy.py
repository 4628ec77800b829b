"""Lab faults that a deploy must turn into a clear refusal naming the fix.

Each test boots the lab with one fault switched on and deploys the default target.
(The hardware faults of host preparation are in test_prepare_faults.py.)
"""

from __future__ import annotations

import pytest
from labutil import fab, ssh

from gpufleet_lab import hosts as lab_hosts

pytestmark = pytest.mark.lab


@pytest.fixture
def faulted(_lab_session):
    def up(*faults: str):
        lab_hosts.up(hosts=2, faults=list(faults))
    yield up
    lab_hosts.up(hosts=2)  # the next test gets a clean lab


# The lab's FlashInfer faults are lab lock variants (lab/gpufleet_lab/wheels.py): a site lock
# with FlashInfer below the floor, or with a flashinfer-cubin companion at another version.
@pytest.mark.parametrize("fault,found", [
    # slow (about 100 s each, a faulted lab and a deploy): tests/unit/test_venv_check.py
    # runs the same check under every host Python
    pytest.param("flashinfer-old", "flashinfer-python 0.6.16.", marks=pytest.mark.slow),
    pytest.param("flashinfer-split", "flashinfer-python 0.7.2.post1, flashinfer-cubin 0.6.16.",
                 marks=pytest.mark.slow),
])
def test_a_stale_flashinfer_is_refused_by_the_engine_runtime(faulted, fault, found):
    faulted(fault)
    proc = fab("deploy", "--target", "h200-pd-1node")
    assert proc.returncode == 1
    out = " ".join(proc.stdout.split())
    lock = f"/var/lib/gpufleet-lab/locks/{fault}/vllm-x86_64-py311.txt"
    assert f"{lock}): {found}" in out, out[-3000:]
    assert "needs flashinfer-python >= 0.6.18" in out
    assert "Fix: a lock with flashinfer-python >= 0.6.18" in out
    # refused before anything was served
    installed = ssh("lab1", "grep -l '^# gpufleet: installed by' /etc/systemd/system/*; true")
    assert installed.strip() == ""


def test_a_small_cache_filesystem_is_refused_before_any_byte_moves(faulted):
    faulted("disk-small")
    proc = fab("deploy", "--target", "h200-pd-1node")
    assert proc.returncode == 1
    text = " ".join(proc.stdout.split())
    assert "GiB free" in text and "336.6 GiB" in text
    assert ssh("lab1", "ls -A /var/cache/gpufleet/hf").strip() == ""
