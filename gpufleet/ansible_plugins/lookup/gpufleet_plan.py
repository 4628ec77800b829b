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
  - >-
    Returns the plan (processes, host requirements, cache) that C(fab plan) prints, made by
    the same planner from the inventory Ansible already parsed. A problem with the target,
    the inventory or an override fails the play with the planner's message, before any
    host is touched.
  - >-
    playbooks/plan.yml calls it where fab did not hand its own plan over
    (C(gpufleet_plan_json)), so for a plain ansible-playbook run or an AWX job. fab reads
    the same variables from the inventory and lays its command-line options on top.
  - >-
    The target is the first term, else the C(gpufleet_target) variable. fab's equivalent
    is C(--target NAME).
  - >-
    The overrides below are read from the inventory where every host has the same value (a
    variable of group C(all), say), else from the variables the play sees on the controller
    (an extra variable given with C(-e), say).
  - >-
    C(gpufleet_with) is the list of options layered on the target (hicache, cp, layer-split,
    dflash2, fp8-kv), or one comma-separated string. fab's C(--with hicache,cp) adds to it.
  - >-
    C(gpufleet_args) maps a role (etcd, worker, prefill, decode, router, or C(engines) for
    every GPU engine) to command-line flags and their values, and null drops a flag. fab's
    C(--set ROLE:--flag=VALUE) sets one flag on top of it and C(--unset ROLE:--flag) drops
    one.
  - >-
    C(gpufleet_env) maps a role (or C(engines)) to environment variables of its units, and
    null drops one. fab's C(--set ROLE:NAME=VALUE) and C(--unset ROLE:NAME) do the same for
    one variable.
  - >-
    C(gpufleet_ports) maps a role to its named ports (for example C({router: {http: 8080}})),
    changed everywhere the plan uses them. It has no command-line option.
  - >-
    C(gpufleet_gpus) maps a role to the GPU indices its processes run on (for example a
    6/2 prefill/decode split of one node). It has no command-line option.
  - >-
    C(gpufleet_model_revision) is the checkpoint's branch, tag or commit in place of the
    catalog's. It has no command-line option.
  - >-
    C(gpufleet_cache_dir) is the shared Hugging Face cache every serving host mounts
    (default /var/cache/gpufleet/hf). It has no command-line option.
  - >-
    C(gpufleet_hf_endpoint) is the Hugging Face mirror (HF_ENDPOINT) the download uses. It
    has no command-line option.
  - >-
    C(gpufleet_lab) (default false) marks the inventory of the lab (C(fab lab.up) hosts).
    Only there does the plan take a lab-only target (lab-cpu: vLLM's CPU build serving the
    lab's random-weight model); elsewhere it refuses one. It has no command-line option.
  - >-
    C(gpufleet_api_key) (default true) puts an nginx gateway that checks an API key in front
    of the router. With false the endpoint serves without a key. It has no command-line
    option.
  - >-
    C(gpufleet_api_key_file) is the key file on the controller, in place of
    ~/.config/gpufleet/api-keys/DEPLOYMENT.key (under C($XDG_CONFIG_HOME) where it is set).
    It has no command-line option.
  - >-
    C(gpufleet_tls) (default true) makes the gateway serve HTTPS only; false serves plain
    HTTP (a plan warning says the key crosses the network in clear text).
    C(gpufleet_tls_cert_file) and C(gpufleet_tls_key_file) are the site's certificate (PEM,
    with its chain) and unencrypted key on the controller, checked when planning (the key
    the certificate's, not expired, naming every gateway host); C(gpufleet_tls_ca_file) is
    the CA clients verify it with where their trust store lacks it. Without them the first
    deploy makes a self-signed pair, kept in ~/.config/gpufleet/tls/DEPLOYMENT.crt and .key.
    None has a command-line option.
  - >-
    C(gpufleet_metrics_allow) lists the addresses or networks (for example
    C([10.0.0.5, 10.8.0.0/16])) of the Prometheus servers that may scrape the deployment:
    every host then runs a metrics listener on its address at C(gpufleet_metrics_port)
    (default 9464) that serves each process's metrics at /metrics/PROCESS to those and
    refuses everyone else (C(fab monitoring) writes Prometheus's targets). Empty (the
    default): no listener. C(gpufleet_dcgm_exporter_port) is the port of a dcgm-exporter
    the site runs on every host: the listener serves its metrics too. C(gpufleet_alert_bounds)
    sets the serving alerts' bounds (C(ttft_p99_seconds), C(itl_p99_seconds),
    C(requests_waiting), C(kv_cache_usage), C(gateway_5xx_ratio), C(engine_error_ratio));
    C(fab monitoring --write) records them for Prometheus. None has a command-line option.
  - >-
    C(gpufleet_replicas) (true) runs a single-node target on every host of its group, one
    independent copy each with its own endpoint. It has no command-line option.
  - >-
    C(gpufleet_workers) maps an engine role to how many workers of it run behind the
    target's one router (for example C({prefill: 2, decode: 2}) or C({worker: 4})). It has
    no command-line option.
  - >-
    C(gpufleet_max_unavailable) is how many workers of a pool a rolling restart (fab
    restart, a deploy that changes them) takes out at once: a count, a share of the pool
    (C("25%")), or either per role (C({decode: 2, prefill: "25%"})). Default 1. A batch
    takes at least one worker and never the whole pool; the first batch is the canary. It
    has no command-line option.
  - >-
    C(gpufleet_runtime) is the engine runtime, C(venv) or C(image) (default venv on NVIDIA
    hosts and image on AMD hosts). fab's equivalent is C(--runtime image).
  - >-
    C(gpufleet_images) maps an engine to the image it runs from in place of the catalog's
    (the image runtime), for example C({vllm: REGISTRY/REPO@sha256:...}). It has no
    command-line option.
  - >-
    C(gpufleet_engine_versions) maps an engine to another of its catalog releases, which
    the venv runtime installs beside the others and the engines roll onto, for example
    C({vllm: "0.31.0"}) (the engine's C(releases) in catalog/engines.yml). It has no
    command-line option.
  - >-
    C(gpufleet_registry_mirror) is a registry that serves every image in place of its own
    (an air-gapped site's mirror). It has no command-line option.
  - >-
    C(gpufleet_acknowledge) lists the recipe's pins (a target's C(pins)) that C(gpufleet_args),
    C(gpufleet_env) or C(--set) may change, once the reason the refusal quotes was read. It
    has no command-line option.
  - >-
    C(gpufleet_quarantine) lists hosts to leave out of serving where the deployment can do
    without them (a pool's worker whose pool keeps another, a whole replica), and
    C(gpufleet_max_fail_percentage) (default 10) is the share of the hosts a deploy may
    quarantine after they failed to prepare before it stops instead. Neither has a
    command-line option.
  - >-
    The planner also reads a few variables from the hosts' own variables alone, none of them
    an override and none with a command-line option. C(gpufleet_deployment) names the
    deployment on the controller (its API key file and its hosts record), by default the
    inventory's own name. A host's C(gpufleet_hardware) is what it is, and a target for
    other hardware is refused. A host's C(gpufleet_host_python) is its Python version, which
    picks the engine environment's lock. A host's C(gpufleet_internal_address) (else its
    C(ansible_host), else its name) is the address the other hosts reach it at.
  - >-
    With C(quarantine) (a list of hosts) and C(inputs) (a plan's C(inputs): its target and
    overrides, the command line's included), it plans again from those inputs with the hosts
    left out of serving (C(gpufleet_quarantine)): a deploy does so for hosts that failed
    before serving, where the plan can do without them.
options:
  _terms:
    description: optional target name
    required: false
  quarantine:
    description: hosts to leave out of serving
    type: list
    elements: str
    required: false
  inputs:
    description: the plan's inputs (C(gpufleet_plan.inputs)) to plan again from
    type: dict
    required: false
"""

EXAMPLES = r"""
# playbooks/plan.yml: once per run, fab's plan where fab runs the play, else this lookup's.
# For a plain run, the overrides come from the inventory or from extra variables, e.g.
#   ansible-playbook site.yml -i inventories/h200 -e gpufleet_target=h200-pd-1node \
#     -e '{"gpufleet_with": ["hicache"], "gpufleet_runtime": "image"}'
- name: Compute the deployment plan (once per run)
  ansible.builtin.set_fact:
    gpufleet_plan: >-
      {{ gpufleet_plan if groups['gpufleet_planned'] is defined
         else gpufleet_plan_json if gpufleet_plan_json is defined
         else lookup('gpufleet.fleet.gpufleet_plan') }}

- name: The plan of a target named here, not the inventory's gpufleet_target
  ansible.builtin.debug:
    msg: >-
      {{ lookup('gpufleet.fleet.gpufleet_plan', 'h200-pd-1node').processes
         | map(attribute='name') }}
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
        self.set_options(var_options=variables, direct=kwargs)
        inputs, quarantine = self.get_option("inputs"), self.get_option("quarantine")
        try:
            if inputs:  # the plan made before, from the same inputs (fab's options too)
                name, overrides = inputs["target"], dict(inputs["overrides"])
            else:
                name = cli.target_from(inventory, target)
                overrides = cli.overrides_from(inventory, [], {})
            if quarantine is not None:
                cli.quarantined(overrides, quarantine)
            plan = cli.make_plan(name, inventory, overrides)
        except PlanError as exc:
            raise AnsibleError(f"gpufleet: refusing, nothing was changed:\n{exc}") from None
        return [plan.to_json()]
