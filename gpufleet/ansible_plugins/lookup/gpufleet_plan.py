"""Ansible lookup `gpufleet_plan`: the plan for the current inventory.

Thin by design: it hands the inventory Ansible already parsed (groups, hostvars) to
the same planner `fab plan` uses and returns the plan as data. Problems fail the
play with the planner's message, before any host is touched.
"""

from __future__ import annotations

DOCUMENTATION = r"""
name: gpufleet_plan
short_description: compute the gpufleet deployment plan for this inventory
description:
  - Returns the plan (processes, host requirements, cache) that C(fab plan) prints.
  - The target comes from the first term or the C(gpufleet_target) variable; overrides
    from the C(gpufleet_with), C(gpufleet_args), C(gpufleet_env), C(gpufleet_ports),
    C(gpufleet_model_revision), C(gpufleet_cache_dir) and C(gpufleet_hf_endpoint) variables.
options:
  _terms:
    description: optional target name
    required: false
"""

RETURN = r"""
_raw:
  description: the plan as one dictionary (the JSON of C(fab plan --format json))
  type: list
  elements: dict
"""

from ansible.errors import AnsibleError
from ansible.plugins.lookup import LookupBase

from gpufleet import cli
from gpufleet.inventory import from_ansible_list
from gpufleet.plan import PlanError


class LookupModule(LookupBase):
    def run(self, terms, variables=None, **kwargs):
        variables = variables or {}
        groups = variables.get("groups", {})
        hostvars = variables.get("hostvars", {})
        listing = {"_meta": {"hostvars": {h: dict(hostvars.get(h, {}))
                                          for h in groups.get("all", [])}}}
        listing["all"] = {"children": [g for g in groups if g not in ("all", "ungrouped")],
                          "hosts": list(groups.get("ungrouped", []))}
        for group, hosts in groups.items():
            if group not in ("all", "ungrouped"):
                listing[group] = {"hosts": list(hosts)}
        # the inventory's own path, as `fab` names it: the API key file is keyed on it
        sources = variables.get("ansible_inventory_sources") or ["ansible"]
        inventory = from_ansible_list(listing, source=str(sources[0]))
        for key in cli.INVENTORY_OVERRIDES:
            if key in variables and key not in inventory.vars:
                inventory.vars[key] = variables[key]
        target = terms[0] if terms else variables.get("gpufleet_target")
        try:
            name = cli.target_from(inventory, target)
            overrides = cli.overrides_from(inventory, [], {})
            plan = cli.make_plan(name, inventory, overrides)
        except PlanError as exc:
            raise AnsibleError(f"gpufleet: refusing, nothing was changed:\n{exc}") from None
        return [plan.to_json()]
