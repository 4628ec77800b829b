"""Inventories as the planner sees them: hosts, their groups and variables.

A real inventory is read with Ansible's own parser (`ansible-inventory --list`), so
every format Ansible accepts works. Without one, a target's reference topology gets
placeholder hosts named after the groups it needs.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path


class InventoryError(Exception):
    """The inventory cannot be read; the message names the file and the fix."""


# ansible-inventory runs with these bounds: a YAML alias bomb in a group_vars file (1 KB)
# once took 23 GB and 23 minutes
TIMEOUT_S = 120
MEMORY_BYTES = 4 << 30


def _bounded() -> None:  # in the child, before exec: its address space
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))


@dataclass(frozen=True)
class Host:
    name: str
    address: str
    vars: dict = field(default_factory=dict, hash=False, compare=False)


@dataclass
class Inventory:
    hosts: dict[str, Host]
    groups: dict[str, list[str]]
    source: str = "placeholder"
    vars: dict = field(default_factory=dict)  # variables every host shares (group `all`)

    def group(self, name: str) -> list[Host]:
        return [self.hosts[h] for h in self.groups.get(name, [])]


def placeholder(groups: dict[str, int]) -> Inventory:
    """Hosts named <group>-<n> for a topology's groups (fab plan without -i)."""
    hosts: dict[str, Host] = {}
    members: dict[str, list[str]] = {}
    for group, count in groups.items():
        members[group] = []
        for i in range(1, count + 1):
            name = f"{group}-{i}"
            hosts[name] = Host(name=name, address=name)
            members[group].append(name)
    return Inventory(hosts=hosts, groups=members)


def from_ansible_list(data: dict, source: str) -> Inventory:
    """Build an Inventory from the JSON of `ansible-inventory --list`."""
    hostvars = data.get("_meta", {}).get("hostvars", {})
    groups: dict[str, list[str]] = {}

    def walk(group: str) -> list[str]:
        entry = data.get(group, {})
        members = list(entry.get("hosts", []))
        for child in entry.get("children", []):
            members += [h for h in walk(child) if h not in members]
        groups[group] = members
        return members

    walk("all")
    hosts = {}
    for name in groups.get("all", []):
        hv = hostvars.get(name, {})
        address = str(hv.get("gpufleet_internal_address") or hv.get("ansible_host") or name)
        hosts[name] = Host(name=name, address=address, vars=hv)
    shared = {}
    if hosts:
        first = next(iter(hosts.values())).vars
        shared = {
            k: v for k, v in first.items()
            if all(h.vars.get(k) == v for h in hosts.values())
        }
    return Inventory(hosts=hosts, groups=groups, source=source, vars=shared)


def load(path: str, limit: str | None = None) -> Inventory:
    """Read an Ansible inventory (file or directory) with ansible-inventory; with limit,
    only the hosts that host pattern matches."""
    if not Path(path).exists():
        raise InventoryError(
            f"inventory {path!r} does not exist. Fix: pass -i with a file or directory "
            "such as inventories/lab or inventories/h200"
        )
    exe = shutil.which("ansible-inventory") or str(Path(sys.executable).with_name(
        "ansible-inventory"))
    # stdout must be the JSON alone, whatever verbosity the operator asked Ansible for
    env = {**os.environ, "ANSIBLE_VERBOSITY": "0"}
    bound = ("Fix: look for YAML aliases that expand (a &anchor used many times inside "
             "another), or an inventory script that hangs")
    try:
        proc = subprocess.run([exe, "-i", path, "--list",
                               *(["--limit", limit] if limit else [])],
                              capture_output=True, text=True,
                              check=False, env=env, timeout=TIMEOUT_S, preexec_fn=_bounded)
    except subprocess.TimeoutExpired:
        raise InventoryError(f"ansible-inventory took over {TIMEOUT_S} s to read {path!r}. "
                             + bound) from None
    if proc.returncode != 0 and "MemoryError" in proc.stderr:
        raise InventoryError(f"ansible-inventory needed over {MEMORY_BYTES >> 20} MiB to "
                             f"read {path!r}. " + bound)
    if proc.returncode != 0:
        raise InventoryError(
            f"ansible-inventory could not read {path!r}: {proc.stderr.strip()[-500:]}. "
            "Fix: correct the inventory syntax (see inventories/sample/)"
        )
    inv = from_ansible_list(json.loads(proc.stdout), source=path)
    if not inv.hosts:
        raise InventoryError(
            f"inventory {path!r} has no hosts. Fix: add hosts to the groups the target "
            "needs (fab plan --target NAME shows them)"
        )
    return inv
