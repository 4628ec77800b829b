"""Ansible module gpufleet_units: state of the plan's units on this host (read-only)."""

from __future__ import annotations

DOCUMENTATION = r"""
module: gpufleet_units
short_description: Report the state, uptime, restarts and readiness of gpufleet units
description:
  - For each process of the plan on this host, reads systemd's view of its unit and asks
    its health endpoint (one short request). Changes nothing; safe in check mode.
options:
  processes:
    description: The plan's processes on this host (name, role, unit, readiness).
    type: list
    elements: dict
    required: true
  journal_lines:
    description: Also return this many journal lines per unit (0 = none).
    type: int
    default: 0
  health_state:
    description: The health checker's state file, where its last run records a host fault.
    type: path
    default: /var/lib/gpufleet/health-state.json
"""

EXAMPLES = r"""
# fab status and fab logs (playbooks/status.yml): this host's units, or those of the
# roles asked for, with their journal where fab logs asks for it.
- name: Units
  gpufleet.fleet.gpufleet_units:
    processes: >-
      {{ gpufleet_host.processes | selectattr('role', 'in', status_roles) | list
         if status_roles is defined else gpufleet_host.processes }}
    journal_lines: "{{ status_journal_lines | default(0) | int }}"
  register: gpufleet_status

# The deploy's last check (playbooks/verify.yml): read twice, a moment apart, so that a
# unit restarting in a loop shows in its restart count.
- name: State and restart count
  gpufleet.fleet.gpufleet_units:
    processes: "{{ gpufleet_host.processes }}"
  register: __verify_units
"""

RETURN = r"""
units:
  description: >-
    One entry per process given, in their order. Each has name, role and unit (from the
    plan), loaded (systemd knows the unit), active and sub (ActiveState and SubState),
    uptime_s (0 unless active), restarts (NRestarts), main_pid, ready and, with
    I(journal_lines), journal (journalctl -o short-iso). ready is true when the health
    URL answers 200, null when the process has no health URL, and false otherwise or
    when the unit is not active.
  type: list
  elements: dict
  returned: always
  sample:
    - name: decode
      role: decode
      unit: gpufleet-decode.service
      loaded: true
      active: active
      sub: running
      uptime_s: 5230
      restarts: 0
      main_pid: 48113
      ready: true
host_fault:
  description: >-
    The health checker's last run, where it found the host sick. It names the failing
    host checks that hold the engines' restarts (checks, since), when the checker last
    wrote its state (updated) and the engine units it stopped (drained). Null when the
    host is not sick or the checker never ran.
  type: dict
  returned: always
  sample: {checks: [gpu_xid], since: 1748770000.0, updated: 1748770300.0, drained: []}
"""

import json
import ssl
import subprocess
import time
import urllib.error
import urllib.request

from ansible.module_utils.basic import AnsibleModule

PROPS = "ActiveState,SubState,ActiveEnterTimestampMonotonic,NRestarts,MainPID,LoadState"


def show(unit):
    out = subprocess.run(["systemctl", "show", "-p", PROPS, unit], capture_output=True,
                         text=True, check=False).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def ready(readiness):
    """Whether the readiness url answers 200 (an https one verified with its CA file, as
    the deploy's probe does); None where the process has no url."""
    url = readiness.get("url")
    if not url:
        return None
    try:
        context = ssl.create_default_context(cafile=readiness.get("ca_file")) \
            if url.startswith("https:") else None
        with urllib.request.urlopen(url, timeout=3, context=context) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def host_fault(path):
    try:
        with open(path, encoding="utf-8") as handle:
            state = json.load(handle)
    except (OSError, ValueError):
        return None
    fault = state.get("host_fault") if isinstance(state, dict) else None
    if not isinstance(fault, dict):
        return None
    return dict(fault, updated=state.get("updated"), drained=state.get("drained") or [])


def main():
    module = AnsibleModule(
        argument_spec={
            "processes": {"type": "list", "elements": "dict", "required": True},
            "journal_lines": {"type": "int", "default": 0},
            "health_state": {"type": "path",
                             "default": "/var/lib/gpufleet/health-state.json"},
        },
        supports_check_mode=True,
    )
    now = time.clock_gettime(time.CLOCK_MONOTONIC)
    units = []
    for proc in module.params["processes"]:
        state = show(proc["unit"])
        entered = int(state.get("ActiveEnterTimestampMonotonic") or 0) / 1e6
        active = state.get("ActiveState", "unknown")
        entry = {
            "name": proc["name"], "role": proc["role"], "unit": proc["unit"],
            "loaded": state.get("LoadState") == "loaded",
            "active": active, "sub": state.get("SubState"),
            "uptime_s": round(now - entered) if active == "active" and entered else 0,
            "restarts": int(state.get("NRestarts") or 0),
            "main_pid": int(state.get("MainPID") or 0),
            "ready": ready(proc.get("readiness") or {}) if active == "active"
            else False,
        }
        if module.params["journal_lines"]:
            entry["journal"] = subprocess.run(
                ["journalctl", "-u", proc["unit"], "-n", str(module.params["journal_lines"]),
                 "--no-pager", "-o", "short-iso"],
                capture_output=True, text=True, check=False).stdout
        units.append(entry)
    module.exit_json(changed=False, units=units,
                     host_fault=host_fault(module.params["health_state"]))


if __name__ == "__main__":
    main()
