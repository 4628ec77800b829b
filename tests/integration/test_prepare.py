"""Host preparation on the lab: preflight then prepare converge, re-run with changed=0,
and --check --diff changes nothing on the hosts (checksums of /etc before and after)."""

from __future__ import annotations

import re
import subprocess

import pytest
from labutil import BIN, ENV, ROOT, recap
from labutil import ssh as lab_ssh

pytestmark = pytest.mark.lab
TARGET = "h200-pd-1node"
OUR_ROLES = ("preflight", "nvidia_driver", "fabric_manager", "imex", "rdma", "ucx", "rocm")
# What the lab's simulated tools keep as state, next to /etc (persistence, loaded modules).
STATE = "/etc /var/lib/gpufleet-lab"


def prepare(*extra: str) -> subprocess.CompletedProcess:
    cmd = [str(BIN / "ansible-playbook"), "-i", "inventories/lab", "playbooks/preflight.yml",
           "playbooks/prepare.yml", "-e", f"gpufleet_target={TARGET}", *extra]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=ENV, timeout=900,
                          check=False)


def changed_tasks(output: str) -> list[str]:
    """'role : task name' of every task that reported changed."""
    tasks, task = [], None
    for line in output.splitlines():
        m = re.match(r"^TASK \[(.*)\] \*", line)
        if m:
            task = m.group(1)
        elif line.startswith("changed:") and task:
            tasks.append(task)
    return tasks


def ssh(host: str, command: str) -> str:
    return lab_ssh(host, command, check=True)


def snapshot(host: str) -> set[str]:
    """'sha256  path' of every regular file under /etc (and the lab's hardware state), plus
    the state of the units the roles manage."""
    out = ssh(host, f"find {STATE} -xdev -type f -print0 2>/dev/null | sort -z"
                    " | xargs -0 sha256sum; for u in nvidia-fabricmanager nvidia-imex; do"
                    " echo $u $(systemctl is-enabled $u) $(systemctl is-active $u); done")
    return set(out.splitlines())


@pytest.fixture(scope="module")
def converged(lab):
    proc = prepare()
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-2000:]
    return proc


def test_prepare_converges_and_leaves_real_state(converged):
    assert "host(s) fit the plan of h200-pd-1node" in converged.stdout
    # nvidia_driver: persistence mode on every GPU, read with nvidia-smi itself
    pm = ssh("lab1", "nvidia-smi --query-gpu=persistence_mode --format=csv,noheader").split()
    assert pm == ["Enabled"] * 8
    # fabric_manager: the unit runs and the GPUs' fabric is Completed
    assert ssh("lab1", "systemctl is-active nvidia-fabricmanager").strip() == "active"
    assert ssh("lab1", "systemctl is-enabled nvidia-fabricmanager").strip() == "enabled"
    fabric = ssh("lab1", "nvidia-smi --query-gpu=fabric.state --format=csv,noheader").split()
    assert set(fabric) == {"Completed"}
    # ucx: the plan's environment, root-owned, not world-readable
    stat = ssh("lab1", "stat -c '%a %U' /etc/gpufleet/ucx.env").split()
    assert stat == ["640", "root"]
    assert 'UCX_NET_DEVICES="all"' in ssh("lab1", "cat /etc/gpufleet/ucx.env")


# What is in apt's lists directory, by name, size and mtime: `apt-get update` works in
# `partial/` (its mtime moves even when every list was current) and rewrites the lists that
# changed. Not `ls -l`, whose block total moved once on a run that updated nothing.
APT_LISTS = ("find /var/lib/apt/lists -mindepth 1 -maxdepth 1 -printf '%P %s %T@\\n'"
             " | sort")


def test_rerun_changes_nothing(converged):
    lists = ssh("lab1", APT_LISTS)
    proc = prepare()
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert recap(proc.stdout)["lab1"]["changed"] == 0, changed_tasks(proc.stdout)
    # lists refreshed by the first run are fresh: the re-run made no apt update
    assert ssh("lab1", APT_LISTS) == lists


@pytest.mark.parametrize("state, make", [
    # a fresh image that cleaned its lists: apt knows no package, the mtime is new
    ("empty", "rm -rf /var/lib/apt/lists/* && touch /var/lib/apt/lists"),
    # lists older than the hourly cache_valid_time
    ("stale", "find /var/lib/apt/lists -maxdepth 1 -exec touch -d '3 hours ago' {} +"),
])
def test_apt_lists_empty_or_stale_are_refreshed(converged, state, make):
    # a re-run where nothing changed installs nothing and so updates nothing; a role that
    # installs (here engine_runtime, its record gone as on a re-imaged host) refreshes them
    ssh("lab1", f"{make} && rm -f /var/lib/gpufleet/state/engine_runtime.json")
    before = ssh("lab1", APT_LISTS)
    proc = prepare()
    assert proc.returncode == 0, proc.stdout[-4000:]
    after = ssh("lab1", APT_LISTS)
    assert after != before, f"{state} apt lists were not refreshed"
    assert "_Packages" in after


def test_check_diff_changes_nothing_on_the_hosts(converged):
    before = snapshot("lab1")
    proc = prepare("--check", "--diff")
    assert proc.returncode == 0, proc.stdout[-4000:]
    after = snapshot("lab1")
    assert before == after, sorted(before ^ after)
    # the task headers name the roles by their full names (gpufleet.fleet.preflight : ...)
    ours = [t for t in changed_tasks(proc.stdout)
            if t.split(" : ")[0].removeprefix("gpufleet.fleet.") in OUR_ROLES]
    assert ours == [], ours


@pytest.mark.slow  # about 2 minutes: the roles' own scenario, what the tests above prove
def test_molecule_scenario_converges_is_idempotent_and_verifies(converged):
    """The roles' molecule scenario (molecule/default) on the lab hosts."""
    proc = subprocess.run([str(BIN / "molecule"), "test"], cwd=ROOT, capture_output=True,
                          text=True, env=ENV, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    assert "idempotence" in proc.stdout + proc.stderr
