"""Ansible module gpufleet_probe: many HTTP and closed-port checks at once (read-only)."""

from __future__ import annotations

DOCUMENTATION = r"""
module: gpufleet_probe
short_description: Run many HTTP and closed-port checks side by side, in one module run
description:
  - Each check is one short GET (its status among those expected, and optionally a line of
    its body matching a regular expression) or one TCP port that must refuse connections.
    The checks run side by side (up to 32 at once), so a deployment's checks cost one
    module run rather than one per endpoint, port or path.
  - Reports every check's result and fails only when a check cannot be given (a CA file
    that cannot be read, a key file that cannot be read); the play decides what a failed
    check means and says the fix. Changes nothing; safe in check mode.
options:
  checks:
    description: >-
      The checks. Each has C(name) (free text, returned) and either C(url) (with
      C(status), a list of the accepted statuses, default [200]; C(match), a regular
      expression one line of the body must match; C(key), true to send the key as a
      bearer token) or C(port) (and C(host), default 127.0.0.1): a port that must not
      accept a connection. Other keys are returned as given.
    type: list
    elements: dict
    required: true
  key_file:
    description: >-
      The file holding the key sent by the checks with C(key) (read here, so the key is
      never a task argument). Never returned.
    type: path
  ca_file:
    description: The CA HTTPS checks verify the certificate with (none, the trust store).
    type: path
  timeout:
    description: Seconds each request may take.
    type: float
    default: 10
  wait:
    description: Seconds a port may take to close before its check fails.
    type: float
    default: 3
"""

EXAMPLES = r"""
# playbooks/verify.yml: the endpoint refuses a request without the key and serves one
# with it, and a loopback port answers nothing from the controller
- name: Verify | Probe | Every endpoint and closed port at once
  gpufleet.fleet.gpufleet_probe:
    checks:
      - {name: refused, url: "https://10.0.0.1:8000/v1/models", status: [401, 403]}
      - {name: served, url: "https://10.0.0.1:8000/v1/models", key: true}
      - {name: closed, host: 10.0.0.1, port: 8100}
    key_file: /root/.config/gpufleet/lab/api-key
  register: __verify_probe
"""

RETURN = r"""
checks:
  description: >-
    Each check as given, in order, with ok (passed), and for a request its status (null
    when nothing answered) and error (why nothing answered, or what the body lacked).
  type: list
  elements: dict
  returned: always
  sample:
    - {name: refused, url: "https://10.0.0.1:8000/v1/models", status: 401, ok: true, error: ""}
    - {name: closed, host: 10.0.0.1, port: 8100, ok: true}
failed_checks:
  description: The checks that did not pass (as in I(checks)).
  type: list
  elements: dict
  returned: always
"""

import ssl

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.gpufleet.fleet.plugins.module_utils.probes import run


def main():
    module = AnsibleModule(
        argument_spec={
            "checks": {"type": "list", "elements": "dict", "required": True},
            "key_file": {"type": "path", "no_log": False},
            "ca_file": {"type": "path"},
            "timeout": {"type": "float", "default": 10},
            "wait": {"type": "float", "default": 3},
        },
        supports_check_mode=True,
    )
    p = module.params
    key = None
    if any(c.get("key") for c in p["checks"]):
        try:
            with open(p["key_file"] or "") as fh:
                key = fh.read().strip()
        except OSError as exc:
            module.fail_json(msg=f"cannot read the key file {p['key_file']}: {exc}")
        module.no_log_values.add(key)
    context = None
    if any(str(c.get("url", "")).startswith("https:") for c in p["checks"]):
        try:
            context = ssl.create_default_context(cafile=p["ca_file"])
        except (OSError, ssl.SSLError) as exc:
            module.fail_json(msg=f"cannot read the CA file {p['ca_file']}: {exc}")
    results = run(p["checks"], key, context, p["timeout"], p["wait"])
    module.exit_json(changed=False, checks=results,
                     failed_checks=[r for r in results if not r["ok"]])


if __name__ == "__main__":
    main()
