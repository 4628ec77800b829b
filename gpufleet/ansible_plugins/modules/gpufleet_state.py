"""Ansible module gpufleet_state: has anything a role manages drifted since it converged?"""

from __future__ import annotations

DOCUMENTATION = r"""
module: gpufleet_state
short_description: One host-side check that proves a role's work still holds, and its record
description:
  - >-
    C(state=check) (read-only, also in check mode) reads the record the role left when it
    last converged on this host and compares it with the host as it is now and with the
    role's inputs. The role is C(drifted) when there is no record, its inputs changed
    (the plan, the role's variables or the role itself, hashed into C(digest)), or anything it
    recorded differs: a file's content, mode or owner, a unit not active or not enabled,
    a Debian package's version, the packages installed in a venv, a directory tree's
    files, or a restart a previous run left pending.
  - >-
    C(state=record) (not in check mode) writes that record after the role converged:
    the digest and the current state of everything listed, plus the facts the role
    exports to later roles, which a C(check) that finds nothing drifted returns again.
  - >-
    Records live in I(dir) (root only, 0700).
options:
  role:
    description: The role's name.
    type: str
    required: true
  digest:
    description: Hash of the role's inputs (lookup gpufleet_role_inputs).
    type: str
    required: true
  state:
    description: check or record.
    type: str
    choices: [check, record]
    default: check
  files:
    description: Files the role manages (absent ones recorded as absent).
    type: list
    elements: str
    default: []
  units:
    description: Units that must be active and enabled.
    type: list
    elements: str
    default: []
  packages:
    description: Debian packages whose installed versions are recorded.
    type: list
    elements: str
    default: []
  venvs:
    description: Venvs whose installed distributions (name and version) are recorded.
    type: list
    elements: str
    default: []
  trees:
    description: Directories whose files (path, size, mtime, mode, link target) are recorded.
    type: list
    elements: str
    default: []
  pending:
    description: Directories that must be empty (marks of work a run left undone).
    type: list
    elements: str
    default: []
  observed:
    description: >-
      What this run's facts say about the role's work; recorded, and drift when it differs.
    type: dict
    default: {}
  facts:
    description: >-
      Facts the role exports; returned as ansible_facts by a check that finds nothing drifted.
    type: dict
    default: {}
  dir:
    description: Where records are kept.
    type: str
    default: /var/lib/gpufleet/state
"""

EXAMPLES = r"""
# The first task of a role: when its inputs hash to what it last converged with and
# nothing it recorded drifted, the role has nothing to do (and its exported facts are
# back). check_mode: false lets a dry run say what would change.
- name: Converged, nothing drifted?
  gpufleet.fleet.gpufleet_state:
    role: rdma
    digest: "{{ lookup('gpufleet.fleet.gpufleet_role_inputs') }}"
    observed: "{{ __rdma_observed }}"
  register: __rdma_state
  check_mode: false

# The role's last task once it converged (roles/common/tasks/record.yml): the digest
# the check returned and what the role manages, as it is now.
- name: "Record what converged: rdma"
  gpufleet.fleet.gpufleet_state:
    role: rdma
    state: record
    digest: "{{ __rdma_state.digest }}"
    observed: "{{ __rdma_observed }}"
    files: [/etc/modules-load.d/nvidia-peermem.conf]
    packages: [rdma-core, ibverbs-utils, infiniband-diags]
    facts: {gpufleet_rdma_hcas: "{{ gpufleet_rdma_hcas }}"}
    dir: /var/lib/gpufleet/state
  when: not ansible_check_mode

- name: "Record what converged: health"
  gpufleet.fleet.gpufleet_state:
    role: health
    state: record
    digest: "{{ __health_state.digest }}"
    files:
      - /usr/local/lib/gpufleet/healthcheck.py
      - /etc/systemd/system/gpufleet-health.service
      - /etc/systemd/system/gpufleet-health.timer
    units: [gpufleet-health.timer]
    trees: [/etc/systemd/system/gpufleet-health.service.d]
  when: not ansible_check_mode
"""

RETURN = r"""
drifted:
  description: True when the role must run (no record, inputs changed, or the host differs).
    Always false after C(record).
  type: bool
  returned: always
reasons:
  description: What differs, one line each (empty when nothing drifted).
  type: list
  elements: str
  returned: always
  sample: ["inputs changed (plan, variables or the role)"]
drift:
  description: >-
    The reasons by kind (record, inputs, observed, files, units, packages, venvs, trees,
    pending), each a list of lines.
  type: dict
  returned: with C(state=check)
  sample: {units: [gpufleet-health.timer is inactive]}
digest:
  description: The digest given (what C(record) must be given after the role converged).
  type: str
  returned: always
ansible_facts:
  description: The facts the role exported when it last recorded (I(facts)), set again on
    the host.
  type: dict
  returned: with C(state=check), when nothing drifted
"""

import glob
import hashlib
import json
import os
import subprocess

from ansible.module_utils.basic import AnsibleModule


def file_state(path):
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    out = {"mode": f"{st.st_mode & 0o7777:04o}", "uid": st.st_uid, "gid": st.st_gid}
    if os.path.islink(path):
        out["link"] = os.readlink(path)
    elif os.path.isfile(path):
        digest = hashlib.sha256()
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
        out["sha256"] = digest.hexdigest()
    return out


def unit_state(units):
    if not units:
        return {}
    proc = subprocess.run(["systemctl", "show", "-p", "Id,ActiveState,UnitFileState", "--",
                           *units], capture_output=True, text=True, check=False)
    out = {}
    blocks = proc.stdout.strip().split("\n\n") if proc.stdout.strip() else []
    for unit, block in zip(units, blocks):
        fields = dict(line.split("=", 1) for line in block.splitlines() if "=" in line)
        out[unit] = {"active": fields.get("ActiveState", ""),
                     "enabled": fields.get("UnitFileState", "")}
    for unit in units:
        out.setdefault(unit, {"active": "unknown", "enabled": "unknown"})
    return out


def package_state(names):
    if not names:
        return {}
    fmt = "${Package} ${db:Status-Abbrev} ${Version}\n"
    proc = subprocess.run(["dpkg-query", "-W", "-f", fmt, "--", *names],
                          capture_output=True, text=True, check=False)
    out = {name: None for name in names}
    for line in proc.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[1].startswith("ii"):
            out[parts[0].split(":")[0]] = parts[-1]
    return out


def venv_state(venv):
    """name==version of every distribution in the venv (its *.dist-info directories)."""
    found = glob.glob(os.path.join(venv, "lib", "python3*", "site-packages", "*.dist-info"))
    return sorted(os.path.basename(p)[: -len(".dist-info")] for p in found)


def tree_state(top):
    if not os.path.isdir(top):
        return None
    digest = hashlib.sha256()
    count = 0
    for root, dirs, files in os.walk(top):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            st = os.lstat(path)
            link = os.readlink(path) if os.path.islink(path) else ""
            rel = os.path.relpath(path, top)
            line = f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_mode:o}\0{link}\n"
            digest.update(line.encode())
            count += 1
    return {"files": count, "sha256": digest.hexdigest()}


def measure(p):
    return {
        "files": {path: file_state(path) for path in p["files"]},
        "units": unit_state(p["units"]),
        "packages": package_state(p["packages"]),
        "venvs": {venv: venv_state(venv) for venv in p["venvs"]},
        "trees": {top: tree_state(top) for top in p["trees"]},
    }


def differences(recorded, now):
    reasons = []
    for path, want in recorded.get("files", {}).items():
        have = now["files"].get(path)
        if have != want:
            what = ("is missing" if have is None else "should not exist" if want is None
                    else "changed (" + ", ".join(k for k in sorted(set(want) | set(have))
                                                 if want.get(k) != have.get(k)) + ")")
            reasons.append(("files", f"{path} {what}"))
    for unit, want in recorded.get("units", {}).items():
        have = now["units"].get(unit, {})
        if have.get("active") != "active":
            reasons.append(("units", f"{unit} is {have.get('active') or 'unknown'}"))
        if have.get("enabled") != want.get("enabled"):
            reasons.append(("units", f"{unit} is {have.get('enabled')}, was {want.get('enabled')}"))
    for name, want in recorded.get("packages", {}).items():
        have = now["packages"].get(name)
        if have != want:
            reasons.append(("packages", f"package {name} is {have or 'not installed'}, was {want}"))
    for venv, want in recorded.get("venvs", {}).items():
        if venv not in now["venvs"]:
            continue  # one the role no longer names (another engine release): kept as it is
        have = now["venvs"][venv]
        if have != want:
            changed = sorted(set(want) ^ set(have))
            reasons.append(("venvs", f"{venv}: {', '.join(changed[:6]) or 'changed'}"))
    for top, want in recorded.get("trees", {}).items():
        if now["trees"].get(top) != want:
            reasons.append(("trees", f"{top}: files changed"))
    return reasons


def main():
    module = AnsibleModule(
        argument_spec=dict(
            role=dict(type="str", required=True),
            digest=dict(type="str", required=True),
            state=dict(type="str", default="check", choices=["check", "record"]),
            files=dict(type="list", elements="str", default=[]),
            units=dict(type="list", elements="str", default=[]),
            packages=dict(type="list", elements="str", default=[]),
            venvs=dict(type="list", elements="str", default=[]),
            trees=dict(type="list", elements="str", default=[]),
            pending=dict(type="list", elements="str", default=[]),
            observed=dict(type="dict", default={}),
            facts=dict(type="dict", default={}),
            dir=dict(type="str", default="/var/lib/gpufleet/state"),
        ),
        supports_check_mode=True,
    )
    p = module.params
    path = os.path.join(p["dir"], p["role"] + ".json")
    if p["state"] == "record":
        if module.check_mode:
            module.exit_json(changed=False, drifted=False, reasons=[], digest=p["digest"])
        record = {"digest": p["digest"], "pending": p["pending"], "facts": p["facts"],
                  "observed": p["observed"], **measure(p)}
        os.makedirs(p["dir"], mode=0o700, exist_ok=True)
        os.chmod(p["dir"], 0o700)
        tmp = path + ".tmp"
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as fh:
            json.dump(record, fh, indent=1, sort_keys=True)
        os.replace(tmp, path)
        # the record is bookkeeping, not a change to the host's managed state
        module.exit_json(changed=False, drifted=False, reasons=[], digest=p["digest"])
    try:
        with open(path) as fh:
            recorded = json.load(fh)
    except FileNotFoundError:
        module.exit_json(changed=False, drifted=True, reasons=["no record of a converged run"],
                         drift={"record": ["none"]}, digest=p["digest"])
    except ValueError as exc:
        module.exit_json(changed=False, drifted=True, reasons=[f"record unreadable: {exc}"],
                         drift={"record": [str(exc)]}, digest=p["digest"])
    reasons = []  # (kind, what)
    if recorded.get("digest") != p["digest"]:
        reasons.append(("inputs", "inputs changed (plan, variables or the role)"))
    elif recorded.get("observed", {}) != p["observed"]:
        reasons.append(("observed", "this run's facts differ: " + ", ".join(
            sorted(k for k in set(p["observed"]) | set(recorded.get("observed", {}))
                   if p["observed"].get(k) != recorded.get("observed", {}).get(k)))))
    else:
        spec = {key: list(recorded.get(key, {})) for key in
                ("files", "units", "packages", "venvs", "trees")}
        reasons = differences(recorded, measure(spec))
        for marks in recorded.get("pending", []):
            if os.path.isdir(marks) and os.listdir(marks):
                reasons.append(("pending",
                                f"{marks}: {', '.join(sorted(os.listdir(marks)))} pending"))
    drift = {}
    for kind, what in reasons:
        drift.setdefault(kind, []).append(what)
    result = {"changed": False, "drifted": bool(reasons), "digest": p["digest"],
              "reasons": [what for _, what in reasons], "drift": drift}
    if not reasons:
        result["ansible_facts"] = recorded.get("facts", {})
    module.exit_json(**result)


if __name__ == "__main__":
    main()
