"""Ansible module gpufleet_host_lock: one deploy at a time changes a host's units."""

from __future__ import annotations

DOCUMENTATION = r"""
module: gpufleet_host_lock
short_description: Hold or release the host's deploy lock (the health checker honours it)
description:
  - >-
    C(state=held) writes I(path) (a small JSON file: holder, start, expiry) unless another
    holder's unexpired lock is there, which fails naming that holder, when it started and
    when it expires: a second deploy of the deployment from another controller stops
    before it touches a unit. A holder's own lock (its earlier run that was killed) is
    taken over. The health checker neither restarts nor drains while an unexpired lock is
    there. C(state=released) removes the lock where this holder holds it.
  - >-
    The lock lives under /run: a reboot drops it. It is not a change to the host's
    configuration: the module never reports changed.
options:
  holder:
    description: Who deploys (user@controller and the deployment).
    type: str
    required: true
  state:
    description: held or released.
    type: str
    choices: [held, released]
    default: held
  ttl_s:
    description: Seconds the lock holds without being taken again (a killed deploy's lock
      expires after it).
    type: int
    default: 3600
  path:
    description: The lock file.
    type: str
    default: /run/gpufleet/deploy.lock
"""

EXAMPLES = r"""
# The first play of a deploy (playbooks/serve.yml) and of fab restart, on every planned
# host before any unit changes. gpufleet_controller is user@controller, set by
# playbooks/plan.yml.
- name: One deploy at a time
  gpufleet.fleet.gpufleet_host_lock:
    holder: "{{ gpufleet_controller }}"
    ttl_s: "{{ gpufleet_deploy_lock_ttl_s | default(3600) }}"

# The last play, once every unit serves. A lock another holder took meanwhile is left alone.
- name: Released
  gpufleet.fleet.gpufleet_host_lock:
    holder: "{{ gpufleet_controller }}"
    state: released
"""

RETURN = r"""
holder:
  description: >-
    The holder given, on success. When another holder's unexpired lock stops the module,
    it fails and C(holder) is that lock as its file has it (holder, started and expires
    in Unix seconds, and pid).
  type: raw
  returned: always
  sample: ops@controller-1
msg:
  description: Who holds the host, since when and when the lock expires, and the fix.
  type: str
  returned: failure
  sample: >-
    another deploy holds this host: ops@controller-2 since 2025-06-01 09:12:44 UTC
    (expires in 3412 s). Fix: wait for it to end; if it died, remove
    /run/gpufleet/deploy.lock on this host
"""

import json
import os
import time

from ansible.module_utils.basic import AnsibleModule


def read(path):
    """The lock's content, or None where there is none (or it is unreadable)."""
    try:
        with open(path, encoding="utf-8") as handle:
            lock = json.load(handle)
        return lock if isinstance(lock, dict) else None
    except (OSError, ValueError):
        return None


def blocking(lock, holder, now):
    """The other holder's lock that stops this one, else None."""
    if not lock or lock.get("holder") == holder:
        return None
    expires = lock.get("expires")
    return lock if isinstance(expires, (int, float)) and expires > now else None


def describe(lock, now):
    return "{} since {} (expires in {:.0f} s)".format(
        lock.get("holder", "?"),
        time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(lock.get("started", now))),
        lock.get("expires", now) - now)


def write(path, lock):
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(lock, handle)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def main():
    module = AnsibleModule(
        argument_spec={"holder": {"type": "str", "required": True},
                       "state": {"type": "str", "default": "held",
                                 "choices": ["held", "released"]},
                       "ttl_s": {"type": "int", "default": 3600},
                       "path": {"type": "str", "default": "/run/gpufleet/deploy.lock"}},
        supports_check_mode=True)
    p = module.params
    now = time.time()
    lock = read(p["path"])
    other = blocking(lock, p["holder"], now)
    if other:
        module.fail_json(msg="another deploy holds this host: {}. Fix: wait for it to "
                         "end; if it died, remove {} on this host".format(
                             describe(other, now), p["path"]), holder=other)
    if module.check_mode:
        module.exit_json(changed=False, holder=p["holder"])
    if p["state"] == "held":
        write(p["path"], {"holder": p["holder"], "started": now, "expires": now + p["ttl_s"],
                          "pid": os.getppid()})
    elif lock and lock.get("holder") == p["holder"]:
        os.unlink(p["path"])
    module.exit_json(changed=False, holder=p["holder"])


if __name__ == "__main__":
    main()
