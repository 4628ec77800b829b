"""Ansible lookup `gpufleet_role_inputs`: one hash of everything a role's work depends on.

Used inside a role, as the digest its gpufleet_state record carries: when it is the same
as last time and nothing on the host drifted, the role has nothing to do.
"""

from __future__ import annotations

DOCUMENTATION = r"""
name: gpufleet_role_inputs
short_description: hash of a role's inputs (its files, its variables, this host's plan)
description:
  - >-
    SHA-256 over the role's own files, the host code it installs (gpufleet/host,
    gpufleet/module_utils), and the value of every option its meta/argument_specs.yml
    declares for C(main) (C(gpufleet_host), this host's slice of the plan, is one of
    them), as the role sees them on this host. A role's inputs are its argument spec; an
    option that is not declared does not count (tests/unit/test_role_state.py checks
    that every default is declared).
  - Call it inside the role (it reads C(role_path)).
options:
  _terms:
    description: none
    required: false
"""

EXAMPLES = r"""
# Inside a role: the digest its gpufleet_state check compares with the one it recorded when
# it last converged (each role's tasks/main.yml passes it as gpufleet_state's digest).
- name: This role's inputs, hashed
  ansible.builtin.debug:
    msg: "{{ lookup('gpufleet.fleet.gpufleet_role_inputs') }}"
"""

RETURN = r"""
_raw:
  description: the hex digest
  type: list
  elements: str
"""

import hashlib
import json
from pathlib import Path

import yaml
from ansible.errors import AnsibleError
from ansible.plugins.lookup import LookupBase

# what the roles copy to hosts: the host programs and the GPU facts parser
HOST_CODE = [Path(__file__).resolve().parents[2] / d for d in ("host", "module_utils")]


def files_digest(*tops: Path) -> str:
    digest = hashlib.sha256()
    for top in tops:
        for path in sorted(p for p in top.rglob("*") if p.is_file() and "__pycache__" not in
                           p.parts):
            digest.update(f"{path.relative_to(top)}\0".encode() + path.read_bytes() + b"\0")
    return digest.hexdigest()


def options(role_path: Path) -> list[str]:
    spec = yaml.safe_load((role_path / "meta" / "argument_specs.yml").read_text())
    return sorted(spec["argument_specs"]["main"]["options"])


def option_values(templar, variables: dict, names: list[str]) -> dict:
    """The value of each of a role's options that this host has, templated as the role
    sees it (gpufleet_role_inputs hashes them, gpufleet_role_options hands them over)."""
    return {name: templar.template(variables[name]) for name in names if name in variables}


class LookupModule(LookupBase):
    def run(self, terms, variables=None, **kwargs):
        variables = variables or {}
        if "role_path" not in variables:
            raise AnsibleError("gpufleet_role_inputs: use it inside a role")
        role_path = Path(variables["role_path"])
        values = option_values(self._templar, variables, options(role_path))
        blob = json.dumps(values, sort_keys=True, default=str)
        digest = hashlib.sha256()
        digest.update(files_digest(role_path, *HOST_CODE).encode())
        digest.update(blob.encode())
        return [digest.hexdigest()]
