"""Ansible lookup `gpufleet_role_options`: a role's settings as one dictionary, the list of
them read from its argument spec (so a setting is declared once, in meta/argument_specs.yml,
with its default in defaults/main.yml)."""

from __future__ import annotations

DOCUMENTATION = r"""
name: gpufleet_role_options
short_description: the values of a role's declared settings that carry a prefix
description:
  - Every option the role's meta/argument_specs.yml declares for C(main) whose name starts
    with I(prefix), as this host sees it, keyed by its name without the prefix.
  - Call it inside the role (it reads C(role_path)).
options:
  prefix:
    description: The prefix of the settings (the role's name and an underscore).
    type: str
    required: true
"""

EXAMPLES = r"""
- name: The checker's config from the plan and this role's health_* settings
  ansible.builtin.copy:
    content: >-
      {{ gpufleet_host | gpufleet.fleet.gpufleet_health_config(
           lookup('gpufleet.fleet.gpufleet_role_options', prefix='health_')) | to_json }}
    dest: /etc/gpufleet/health.json
"""

RETURN = r"""
_raw:
  description: name without the prefix -> value
  type: list
  elements: dict
"""

from pathlib import Path

from ansible.errors import AnsibleError
from ansible.plugins.lookup import LookupBase

from gpufleet.ansible_plugins.lookup.gpufleet_role_inputs import option_values, options


class LookupModule(LookupBase):
    def run(self, terms, variables=None, prefix="", **kwargs):
        variables = variables or {}
        if "role_path" not in variables or not prefix:
            raise AnsibleError("gpufleet_role_options: use it inside a role, with prefix=")
        names = [n for n in options(Path(variables["role_path"])) if n.startswith(prefix)]
        unset = [n for n in names if n not in variables]
        if unset:
            raise AnsibleError(f"gpufleet_role_options: {', '.join(unset)} declared in the "
                               "role's argument spec but without a value (defaults/main.yml)")
        values = option_values(self._templar, variables, names)
        return [{name[len(prefix):]: value for name, value in values.items()}]
