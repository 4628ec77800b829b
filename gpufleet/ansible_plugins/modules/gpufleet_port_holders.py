"""Ansible module gpufleet_port_holders: which systemd units listen on some TCP ports."""

from __future__ import annotations

DOCUMENTATION = r"""
module: gpufleet_port_holders
short_description: The systemd units whose processes listen on the given TCP ports
description:
  - Reads the listening sockets of /proc/net/tcp and tcp6 on each port (any address), the
    processes that hold them, and each process's unit from its cgroup. Read-only; runs in
    check mode.
options:
  ports:
    description: TCP ports.
    type: list
    elements: int
    required: true
"""

EXAMPLES = r"""
# Serve, before it starts the changed units of one start order: who holds the ports they
# take. A changed unit of a later order that holds one (a pool's router moving to another
# port, say) is stopped first, since it is restarted later in this run anyway.
- name: Who holds the ports the changed units take
  gpufleet.fleet.gpufleet_port_holders:
    ports: >-
      {{ __serve_procs | selectattr('order', 'equalto', serve_level)
         | selectattr('unit', 'in', __serve_changed)
         | map(attribute='ports') | map('dict2items') | flatten | map(attribute='value')
         | list }}
  register: __serve_holders
  when: not ansible_check_mode

- name: Who listens on the prefill and decode workers' ports
  gpufleet.fleet.gpufleet_port_holders:
    ports: [8001, 8002]
  register: __holders
"""

RETURN = r"""
holders:
  description: >-
    Each port given (as a string key) and the units whose processes listen on it, sorted.
    The list is empty where nothing listens, or only processes outside any unit.
  type: dict
  returned: always
  sample: {"8001": [gpufleet-prefill.service], "8002": []}
units:
  description: Every unit that holds one of the ports, sorted, each once.
  type: list
  elements: str
  returned: always
  sample: [gpufleet-prefill.service]
"""

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.gpufleet.fleet.plugins.module_utils.sockets import (
    holders,
)


def main():
    module = AnsibleModule(argument_spec={"ports": {"type": "list", "elements": "int",
                                                    "required": True}},
                           supports_check_mode=True)
    found = holders(module.params["ports"])
    module.exit_json(changed=False, holders={str(k): v for k, v in found.items()},
                     units=sorted({u for units in found.values() for u in units}))


if __name__ == "__main__":
    main()
