"""Every lab fault fails host preparation in the right role with a named fix, and when
preflight refuses, no file changed on any host.

Each fault rebuilds the lab (gpufleet_lab.hosts.up with that fault), so this module takes
minutes and must not run while someone else uses the lab. The lab goes back to two
fault-free h200x8 hosts at the end.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import gpufleet
from gpufleet_lab import hosts as lab_hosts

pytestmark = pytest.mark.lab
ROOT = Path(gpufleet.__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ENV = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "NO_COLOR": "1",
       "ANSIBLE_FORCE_COLOR": "0"}
HOSTS = ("lab1", "lab2")
STATE = "/etc /var/lib/gpufleet-lab"

# fault -> (profile, target, extra vars, role whose task fails, phrases of the message)
FAULTS = {
    "driver-old": ("h200x8", "h200-disagg", [], "preflight",
                   ["NVIDIA driver 535.274.02 is older than 580.65.06", "Fix: install the R580"]),
    "gpu-missing": ("h200x8", "h200-disagg", [], "preflight",
                    ["7 GPU(s) visible", "nvidia-smi -L"]),
    "no-ib": ("h200x8", "h200-disagg", [], "preflight",
              ["no InfiniBand/RoCE HCA found", "Fix:"]),
    "ib-down": ("h200x8", "h200-disagg", [], "preflight",
                ["HCA port(s) not Active: mlx5_0/1", "subnet manager"]),
    "disk-small": ("h200x8", "h200-disagg", [], "preflight",
                   ["cache filesystem /var/cache/gpufleet/hf has", "Fix: free space"]),
    "fm-mismatch": ("h200x8", "h200-pd-1node", [], "fabric_manager",
                    ["nvidia-fabricmanager 580.126.09 does not match driver 580.159.04",
                     "apt-get install nvidia-fabricmanager-580=580.159.04-1"]),
    "peermem-missing": ("h200x8", "h200-disagg", [], "rdma",
                        ["disagrees about version of symbol", "Fix: reinstall the NVIDIA driver"]),
    "imex-down": ("gb200x4", "gb200-disagg", ["-e", "imex_connect_timeout=10"], "imex",
                  ["IMEX peers are not all connected", "nodes_config.cfg"]),
}


def ssh(host: str, command: str) -> str:
    proc = subprocess.run(lab_hosts.ssh_cmd(host, command), capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, f"{host}: {command}: {proc.stderr}"
    return proc.stdout


def snapshot() -> dict[str, set[str]]:
    cmd = (f"find {STATE} -xdev -type f -print0 2>/dev/null | sort -z | xargs -0 sha256sum;"
           " for u in nvidia-fabricmanager nvidia-imex; do"
           " echo $u $(systemctl is-enabled $u) $(systemctl is-active $u); done")
    return {h: set(ssh(h, cmd).splitlines()) for h in HOSTS}


def failed_task(output: str) -> str:
    """'role : name' of the task that failed first (the TASK header before 'fatal:')."""
    task = ""
    for line in output.splitlines():
        m = re.match(r"^TASK \[(.*)\] \*", line)
        if m:
            task = m.group(1)
        elif line.startswith("fatal:"):
            return task
    return ""


def failed_in(task: str, role: str) -> bool:
    """The role's own task (the header names the role by its full name), or the preflight
    check it includes on its behalf ('gpufleet.fleet.preflight : Preflight | Prepared |
    ...: <role>')."""
    return task.startswith(f"gpufleet.fleet.{role} : ") or task.endswith(f": {role}")


# --slow (about 2 minutes): three more preflight refusals of the same kind as driver-old
# and ib-down, which run every time with one fault per role that names its own
SLOW = {"gpu-missing", "no-ib", "disk-small"}


@pytest.fixture(scope="module", params=[
    pytest.param(f, id=f, marks=pytest.mark.slow) if f in SLOW else pytest.param(f, id=f)
    for f in sorted(FAULTS)])
def faulty_run(request, lab):
    fault = request.param
    profile, target, extra, _, _ = FAULTS[fault]
    try:
        lab_hosts.up(hosts=2, profiles=[profile], faults=[fault])
    except lab_hosts.LabError as exc:
        pytest.fail(f"lab with {fault}: {exc}", pytrace=False)
    before = snapshot()
    cmd = [str(BIN / "ansible-playbook"), "-i", "inventories/lab", "playbooks/preflight.yml",
           "playbooks/prepare.yml", "-e", f"gpufleet_target={target}", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=ENV, timeout=900,
                          check=False)
    yield fault, proc, before, snapshot()


@pytest.fixture(scope="module", autouse=True)
def fault_free_lab_afterwards(lab):
    yield
    lab_hosts.up(hosts=2)


def test_fault_fails_in_the_right_role_with_the_fix(faulty_run):
    fault, proc, _, _ = faulty_run
    _, _, _, role, phrases = FAULTS[fault]
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, f"{fault}: prepare passed\n{out[-3000:]}"
    task = failed_task(proc.stdout)
    assert failed_in(task, role), f"{fault}: failed in {task!r}, not {role}\n{out[-4000:]}"
    for phrase in phrases:
        assert phrase in out, f"{fault}: {phrase!r} not in the output\n{out[-4000:]}"


def test_preflight_refusal_changes_nothing_on_any_host(faulty_run):
    fault, proc, before, after = faulty_run
    if FAULTS[fault][3] != "preflight":
        # what a role repairs or names itself is not refused up front: preflight passed
        assert "nothing was changed on any host" not in proc.stdout
        assert "PLAY [Prepare" in proc.stdout
        return
    assert "nothing was changed on any host" in proc.stdout
    assert "PLAY [Prepare" not in proc.stdout
    for host in HOSTS:
        assert before[host] == after[host], (host, sorted(before[host] ^ after[host]))
