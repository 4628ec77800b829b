"""Ansible module gpufleet_pool: move a pool's worker out of its routers' pools and back in,
take out of a router's pool the workers the plan no longer gives it, or wait until a router
that has just started routes only to workers that serve."""

from __future__ import annotations

DOCUMENTATION = r"""
module: gpufleet_pool
short_description: Take a worker out of its routers' pools and back, through the routers' API
description:
  - Runs on the host of a pool's routers (they answer on loopback) and talks to their worker
    API, as vllm-router and sglang-router serve it (GET /workers lists each worker's url,
    worker_type, id and is_healthy).
  - C(state=out) first waits until every router lists another healthy worker of the
    worker's kind and refuses, changing nothing, when one does not; then sends each
    router that lists the worker its leave call; where the
    routers take a worker back through their API (the move has rejoin calls), it then waits
    until no router lists the worker, so nothing new reaches it before it stops.
  - C(state=in) sends each router that does not list the worker its rejoin call, then, with
    I(wait_s) above 0, waits until every router lists the worker healthy.
  - C(state=dropped) takes out of a router's pool every worker it lists that the plan does
    not keep; a router that does not answer, or none of whose workers the plan keeps (it
    names its workers otherwise), is left alone.
  - C(state=settled) waits until the I(router) lists one healthy worker at least and
    healthy only workers that answer their health check (I(health_path)), since a router
    that has just started takes every worker of its flags as healthy and sends requests to
    one that is down until its own health check has failed it (and sglang-router adds the
    workers of its flags in the background). Sends nothing; fails, naming the worker, after
    I(wait_s).
  - In check mode it reads the routers (a refusal is reported as it would be) and sends
    nothing.
options:
  state:
    description: What to do.
    type: str
    required: true
    choices: [out, in, dropped, settled]
  move:
    description: The worker's pool move (plan readiness.pool); for out and in.
    type: dict
  drop:
    description: The router's drop (plan readiness.drop); for dropped.
    type: dict
  router:
    description: The router (plan readiness.pool.routers item, or readiness.drop with its
      unit); for settled.
    type: dict
  health_path:
    description: The workers' health check path, as the router's (settled).
    type: str
    default: /health
  wait_s:
    description: Seconds to wait for another healthy worker (out), for the worker listed
      healthy again (in; 0 sends the calls only), or for the router to list healthy one
      worker at least and only workers that answer (settled).
    type: int
    default: 60
  unlist_s:
    description: Seconds a router that takes a worker out in the background gets to stop
      listing it (out).
    type: int
    default: 15
  interval:
    description: Seconds between polls of the routers.
    type: float
    default: 2
"""

EXAMPLES = r"""
- name: Out of its routers' pools
  gpufleet.fleet.gpufleet_pool:
    state: out
    move: "{{ restart_proc.readiness.pool }}"
  delegate_to: "{{ restart_proc.readiness.pool.routers[0].host }}"

- name: Back in, and listed healthy by every router
  gpufleet.fleet.gpufleet_pool:
    state: in
    move: "{{ restart_proc.readiness.pool }}"
  delegate_to: "{{ restart_proc.readiness.pool.routers[0].host }}"

- name: The workers the plan drops leave this router's pool
  gpufleet.fleet.gpufleet_pool:
    state: dropped
    drop: "{{ item.readiness.drop }}"
  loop: "{{ gpufleet_host.processes | selectattr('readiness.drop', 'defined') | list }}"

- name: A router just restarted routes only to workers that serve
  gpufleet.fleet.gpufleet_pool:
    state: settled
    router: "{{ restart_one }}"
"""

RETURN = r"""
calls:
  description: The calls sent (or, in check mode, that would be), each C(METHOD URL).
  type: list
  elements: str
  returned: always
elapsed:
  description: Seconds the module took.
  type: float
  returned: always
"""

import time

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.gpufleet.fleet.plugins.module_utils.pool import (
    PoolError,
    back,
    dropped,
    out,
    settled,
)


def main():
    module = AnsibleModule(
        argument_spec={
            "state": {"type": "str", "required": True,
                      "choices": ["out", "in", "dropped", "settled"]},
            "move": {"type": "dict"},
            "drop": {"type": "dict"},
            "router": {"type": "dict"},
            "health_path": {"type": "str", "default": "/health"},
            "wait_s": {"type": "int", "default": 60},
            "unlist_s": {"type": "int", "default": 15},
            "interval": {"type": "float", "default": 2},
        },
        required_if=[("state", "out", ["move"]), ("state", "in", ["move"]),
                     ("state", "dropped", ["drop"]), ("state", "settled", ["router"])],
        supports_check_mode=True,
    )
    p, start = module.params, time.monotonic()
    try:
        if p["state"] == "out":
            calls = out(p["move"], p, module.check_mode)
        elif p["state"] == "in":
            calls = back(p["move"], p, module.check_mode)
        elif p["state"] == "settled":
            calls = settled(p["router"], p, module.check_mode)
        else:
            calls = dropped(p["drop"], module.check_mode)
    except PoolError as exc:
        module.fail_json(msg=str(exc), elapsed=round(time.monotonic() - start, 1))
    module.exit_json(changed=bool(calls), calls=calls,
                     elapsed=round(time.monotonic() - start, 1))


if __name__ == "__main__":
    main()
