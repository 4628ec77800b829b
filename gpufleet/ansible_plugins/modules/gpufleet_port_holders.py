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

RETURN = r"""
holders:
  description: Port -> the units listening on it (empty where none, or not a unit).
  type: dict
  returned: always
units:
  description: Every unit that holds one of the ports.
  type: list
  returned: always
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.sockets import holders


def main():
    module = AnsibleModule(argument_spec={"ports": {"type": "list", "elements": "int",
                                                    "required": True}},
                           supports_check_mode=True)
    found = holders(module.params["ports"])
    module.exit_json(changed=False, holders={str(k): v for k, v in found.items()},
                     units=sorted({u for units in found.values() for u in units}))


if __name__ == "__main__":
    main()
