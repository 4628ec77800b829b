"""Host preparation converges on every lab hardware profile, and re-runs with changed=0.

(h200x8 is covered in depth by test_prepare.py; the others here: Blackwell HGX with the
NVLink subnet manager, a GB200 tray with IMEX; an MI355X node, whose engine no package
index serves for ROCm, is refused; and an NVSwitch fabric managed outside the host: a 2x
H200 virtual machine next to an HGX H200.)
"""

from __future__ import annotations

import json

import pytest
from labutil import playbook, recap, ssh

from gpufleet_lab import hosts as lab_hosts

pytestmark = pytest.mark.lab

# --slow (about 4 minutes): b200x8 (Blackwell HGX: the NVLink subnet manager) repeats the
# NVSwitch path test_prepare.py covers on h200x8, with nvlsm added; gb200x4 (IMEX) is also
# prepared by test_prepare_faults.py's imex-down case, which runs every time
PROFILES = [
    pytest.param(("b200x8", "b200-pd-1node"), marks=pytest.mark.slow, id="b200x8"),
    pytest.param(("gb200x4", "gb200-agg"), marks=pytest.mark.slow, id="gb200x4"),
]


@pytest.fixture(params=PROFILES)
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


def test_amd_host_is_refused_the_package_runtime(_lab_session):
    """No ROCm build of SGLang is installable from the package index (the plan has no lock
    for AMD hosts): asked for the venv runtime, the deploy stops with the image runtime as
    the fix, and no venv is made."""
    lab_hosts.up(hosts=2, profiles=["mi355x8"])
    try:
        run = playbook("-i", "inventories/lab", "playbooks/preflight.yml",
                       "playbooks/prepare.yml", "-e", "gpufleet_target=sglang-mi355x-low-latency",
                       "-e", "gpufleet_runtime=venv")
        said = " ".join(run.stdout.split())
        assert run.returncode != 0, run.stdout[-4000:]
        # the planner refuses it up front; the engine_runtime role would refuse it too
        assert "no ROCm build of sglang" in said and "image runtime" in said, run.stdout[-4000:]
        assert ssh("lab1", "ls /opt/gpufleet/engines 2>/dev/null; true").strip() == ""
    finally:
        lab_hosts.up(hosts=2)


# The fabric_manager role, then the health role, on a plan that needs an NVSwitch fabric on
# both hosts (the planner has no 2-GPU H200 target, so the plan is the roles' part of one).
FABRIC_PLAY = """
- name: Fabric managed here or by the hypervisor
  hosts: lab1:lab2
  become: true
  gather_facts: false
  vars:
    gpufleet_host: "{{ fabric_plan[inventory_hostname] }}"
  roles:
    - role: gpufleet.fleet.fabric_manager
    - role: gpufleet.fleet.health
"""


def _fabric_plan(counts):
    """Each host's slice of such a plan (gpufleet_host)."""
    return {h: {"name": h, "target": "fabric", "model": {"served_name": "none"},
                "processes": [], "fabric_manager": True, "nvlsm": False,
                "gpu": {"vendor": "nvidia", "count": n, "used": list(range(n))}}
            for h, n in counts.items()}


@pytest.mark.slow  # about 40 s: a lab rebuilt with two profiles
def test_vm_fabric_needs_no_fabric_manager_hgx_still_runs_one(_lab_session, tmp_path):
    lab_hosts.up(hosts=2, profiles=["h200x2", "h200x8"])
    try:
        (tmp_path / "play.yml").write_text(FABRIC_PLAY)
        (tmp_path / "plan.json").write_text(
            json.dumps({"fabric_plan": _fabric_plan({"lab1": 2, "lab2": 8})}))
        run = playbook("-i", "inventories/lab", str(tmp_path / "play.yml"),
                       "-e", f"@{tmp_path / 'plan.json'}")
        assert run.returncode == 0, run.stdout[-4000:]
        said = " ".join(run.stdout.split())
        assert "managed outside this host (no NVSwitch here); no local fabric manager" in said
        # the VM: no fabric manager installed or started; the HGX host: running
        assert ssh("lab1", "command -v nv-fabricmanager; systemctl is-active nvidia-fabricmanager"
                   ).split() == ["inactive"]
        assert ssh("lab2", "systemctl is-active nvidia-fabricmanager").strip() == "active"
        # the health checker: the GPUs' fabric state on the VM, the unit on the HGX host
        health = {h: json.loads(ssh(h, "python3 /usr/local/lib/gpufleet/healthcheck.py --json"
                                       " --no-restart 2>/dev/null"))
                  for h in ("lab1", "lab2")}
        units = {h: [c["unit"] for c in r["checks"] if c["unit"]] for h, r in health.items()}
        fabric = {h: next(c for c in r["checks"] if c["check"] == "gpu_fabric")
                  for h, r in health.items()}
        assert units == {"lab1": [], "lab2": ["nvidia-fabricmanager.service"]}, health
        assert "2 GPUs: NVLink fabric Completed/Success" in fabric["lab1"]["detail"], fabric
        assert "8 GPUs: NVLink fabric Completed/Success" in fabric["lab2"]["detail"], fabric
        assert health["lab1"]["healthy"] and health["lab2"]["healthy"], health
    finally:
        lab_hosts.up(hosts=2)


def test_vm_fabric_not_up_is_refused_with_its_state_and_the_fix(_lab_session, tmp_path):
    lab_hosts.up(hosts=1, profiles=["h200x2"], faults=["fabric-pending"])
    try:
        (tmp_path / "play.yml").write_text(FABRIC_PLAY)
        (tmp_path / "plan.json").write_text(json.dumps({"fabric_plan": _fabric_plan({"lab1": 2})}))
        run = playbook("-i", "inventories/lab", "-l", "lab1", str(tmp_path / "play.yml"),
                       "-e", f"@{tmp_path / 'plan.json'}", "-e", "fabric_manager_fabric_timeout=5")
        said = " ".join(run.stdout.split())
        assert run.returncode == 2, run.stdout[-4000:]
        assert "reports Fabric State In Progress, Status N/A" in said, run.stdout[-4000:]
        assert "Fix: the hypervisor's fabric manager" in said
        assert ssh("lab1", "systemctl is-active nvidia-fabricmanager").strip() == "inactive"
    finally:
        lab_hosts.up(hosts=2)
