"""What the lab tests share: running fab and ansible-playbook, ssh into lab hosts, and
reading Ansible's PLAY RECAP."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from gpufleet.lab import hosts as lab_hosts

ROOT = Path(__file__).parents[2]
BIN = Path(sys.executable).parent
ENV = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "NO_COLOR": "1",
       "ANSIBLE_FORCE_COLOR": "0"}


def fab(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "fab"), *args], cwd=ROOT, capture_output=True, text=True,
                          env=ENV, timeout=900, check=False)


def playbook(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "ansible-playbook"), *args], cwd=ROOT,
                          capture_output=True, text=True, env=ENV, timeout=900, check=False)


def ssh(host: str, command: str, check: bool = False) -> str:
    proc = subprocess.run(lab_hosts.ssh_cmd(host, command), capture_output=True, text=True,
                          timeout=120, check=False)
    assert not check or proc.returncode == 0, f"{host}: {command}: {proc.stderr}"
    return proc.stdout


def recap(output: str) -> dict[str, dict[str, int]]:
    """PLAY RECAP counters per host."""
    out = {}
    for host, counters in re.findall(r"^(\S+)\s+:\s+(ok=.*)$", output, re.M):
        out[host] = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", counters)}
    return out
