#!/usr/bin/python
# Copyright: gpufleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Ansible module: one host's facts against the plan (gpufleet module_utils preflight)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: gpufleet_host_check
short_description: Compare one host's GPU, RDMA, CPU and disk facts with the plan
description:
  - C(check=host) calls C(check_host) of gpufleet's module_utils C(preflight) with the plan's
    host requirements, the C(gpu_facts) facts, the CPU architecture and the free space of the
    filesystem that holds (or will hold) the cache path, measured on the nearest existing parent.
  - It also reports ports the plan needs that a process other than a gpufleet unit
    listens on, and a cache path on a read-only or unwritable filesystem.
  - C(check=prepared) calls C(check_prepared) (fabric manager version, IMEX peers,
    nvidia_peermem) after host preparation.
  - Read-only; returns the problems and never fails on them (the caller reports them).
version_added: "0.1.0"
author: gpufleet contributors
options:
  check:
    description: Which comparison to run.
    type: str
    choices: [host, prepared]
    default: host
  requirements:
    description: The plan's entry for this host (C(plan.hosts[inventory_hostname])).
    type: dict
    required: true
  gpu:
    description: The C(gpufleet_gpu) fact.
    type: dict
    default: {}
  ib:
    description: The C(gpufleet_ib) fact.
    type: dict
    default: {}
  cpu_arch:
    description: The host's CPU architecture (C(ansible_architecture)).
    type: str
  cache_path:
    description: The cache directory; free space is measured on its nearest existing parent.
    type: path
  cache_min_free_gib:
    description: Overrides the plan's C(cache.min_free_gib) when set.
    type: float
attributes:
  check_mode:
    support: full
"""

EXAMPLES = r"""
# Preflight, after gpu_facts: the host against its slice of the plan. The cache's free
# space is measured where the cache is (or will be) and the plan's need is scaled down by
# the share of its checkpoints the cache already holds complete, unless the operator set a
# floor of their own (gpufleet_cache_min_free_gib, the preflight role's
# preflight_cache_min_free_gib).
- name: This host against the plan (check_host)
  gpufleet.fleet.gpufleet_host_check:
    check: host
    requirements: "{{ gpufleet_host }}"
    gpu: "{{ ansible_facts.gpufleet_gpu }}"
    ib: "{{ ansible_facts.gpufleet_ib }}"
    cpu_arch: "{{ ansible_facts.gpufleet_machine.cpu_arch }}"
    cache_path: "{{ gpufleet_host.cache.path | default(omit) }}"
    cache_min_free_gib: >-
      {{ preflight_cache_min_free_gib if preflight_cache_min_free_gib | string | length > 0
         else omit }}
  register: __preflight_check
  check_mode: false

# After a preparation role, with fresh gpu_facts: what it set up is in place. The
# caller asserts that __common_prepared.problems is empty and prints them otherwise.
- name: What the fabric manager role set up (check_prepared)
  gpufleet.fleet.gpufleet_host_check:
    check: prepared
    requirements: {fabric_manager: true}
    gpu: "{{ ansible_facts.gpufleet_gpu }}"
    ib: "{{ ansible_facts.gpufleet_ib }}"
  register: __common_prepared
  check_mode: false
"""

RETURN = r"""
problems:
  description: One line per problem, each naming the value and the fix; empty when it fits.
  returned: success
  type: list
  elements: str
  sample:
    - "cache filesystem /var/cache/gpufleet/hf has 212.4 GiB free, the checkpoint needs
      900.0 GiB. Fix: free space or point gpufleet_cache_dir at a larger shared filesystem"
cache_free_gib:
  description: Free GiB on the cache path's filesystem.
  returned: when C(check=host) and I(cache_path) is given
  type: float
  sample: 212.4
cache_missing_share:
  description: >-
    Share (0 to 1) of the plan's checkpoints not yet complete in the cache. A checkpoint
    with a complete gpufleet manifest for its revision needs no room, so the plan's
    C(cache.min_free_gib) is scaled by this share unless I(cache_min_free_gib) is given.
  returned: when C(check=host) and I(cache_path) is given
  type: float
  sample: 1.0
cache_probe_path:
  description: The existing directory that was measured (the cache path or its nearest
    existing parent).
  returned: when C(check=host) and I(cache_path) is given
  type: str
  sample: /var/cache
msg:
  description: Why the free space could not be measured (the module fails only then).
  returned: failure
  type: str
"""

import copy  # noqa: E402 (Ansible modules keep DOCUMENTATION first)
import glob  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402

from ansible.module_utils.basic import AnsibleModule  # noqa: E402
from ansible_collections.gpufleet.fleet.plugins.module_utils.preflight import (
    check_host,
    check_prepared,
    listeners,
)  # noqa: E402


def nearest_existing(path):
    """The path itself or its closest ancestor that exists."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    return probe


def missing_share(cache_path, models):
    """Share (0..1) of the plan's checkpoints not yet complete in the cache: a model with
    a complete gpufleet manifest for its revision needs no room at all."""
    if not models:
        return 1.0
    missing = 0
    for model in models:
        repo_dir = os.path.join(cache_path, "hub", "models--" + model["repo"].replace("/", "--"))
        complete = False
        for manifest in glob.glob(os.path.join(repo_dir, ".gpufleet-manifest-*.json")):
            try:
                with open(manifest) as fh:
                    data = json.load(fh)
            except (OSError, ValueError):
                continue
            if data.get("complete") and model["revision"] in (data.get("revision"),
                                                              data.get("commit")):
                complete = True
        missing += 0 if complete else 1
    return missing / len(models)


def free_gib(path):
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize / 2**30


def main():
    module = AnsibleModule(
        argument_spec={
            "check": {"type": "str", "choices": ["host", "prepared"], "default": "host"},
            "requirements": {"type": "dict", "required": True},
            "gpu": {"type": "dict", "default": {}},
            "ib": {"type": "dict", "default": {}},
            "cpu_arch": {"type": "str"},
            "cache_path": {"type": "path"},
            "cache_min_free_gib": {"type": "float"},
        },
        supports_check_mode=True,
    )
    params = module.params
    req = copy.deepcopy(params["requirements"])
    result = {"changed": False}
    if params["check"] == "prepared":
        result["problems"] = check_prepared(req, params["gpu"], params["ib"])
        module.exit_json(**result)
    free = probe = None
    if params["cache_path"]:
        probe = nearest_existing(params["cache_path"])
        try:
            free = round(free_gib(probe), 1)
        except OSError as exc:
            module.fail_json(msg=f"cannot measure free space on {probe}: {exc}")
        missing = missing_share(params["cache_path"], req.get("cache", {}).get("models"))
        result.update(cache_free_gib=free, cache_probe_path=probe, cache_missing_share=missing)
    if params["cache_min_free_gib"] is not None:
        req.setdefault("cache", {})["min_free_gib"] = params["cache_min_free_gib"]
    elif free is not None and req.get("cache", {}).get("min_free_gib") is not None:
        req["cache"]["min_free_gib"] = round(req["cache"]["min_free_gib"] * missing, 1)
    result["problems"] = check_host(req, params["gpu"], params["ib"], params["cpu_arch"], free,
                                    listening=listeners(), cache_probe=probe)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
