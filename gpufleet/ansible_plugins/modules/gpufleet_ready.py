"""Ansible module gpufleet_ready: wait until a gpufleet unit really serves."""

from __future__ import annotations

DOCUMENTATION = r"""
module: gpufleet_ready
short_description: Wait until a unit's process answers its health endpoint and generates
description:
  - >-
    Polls the health URL until it answers 200, then (when given) sends one real one-token
    generation, then proves the answer came from the unit: every socket listening where the
    URL points (its address, or all addresses, at its port) belongs to a process of the
    unit (its cgroup, or a child of one, as a container's processes are of conmon). Fails
    at once, with the unit's state and the last journal lines, when the unit is failed,
    inactive, waiting to restart, or restarted while waited for (a crash loop is not waited
    out), when another process holds the port, and after I(timeout) seconds.
  - Read-only; safe in check mode (it reports what it would wait for).
options:
  unit:
    description: systemd unit of the process.
    type: str
    required: true
  url:
    description: Health URL (200 when up).
    type: str
    required: true
  generate_url:
    description: OpenAI /v1/completions URL (POST one token) or SGLang /health_generate (GET).
    type: str
  served_name:
    description: Model name for the generation request.
    type: str
  version:
    description: >-
      The engine release the process must report at I(version_url) once its health
      answers (a JSON object's C(version), as vLLM's GET /version gives it). Another
      release fails at once: the unit runs another environment than the plan's.
    type: str
  version_url:
    description: Where the process reports its release (with I(version)).
    type: str
  ca_file:
    description: >-
      An https URL's CA file on the host (PEM): the certificate is verified with it, as
      a client verifies it; without it, with the host's trust store.
    type: str
  timeout:
    description: Seconds to wait in all.
    type: int
    default: 600
  interval:
    description: Seconds between probes.
    type: float
    default: 2
  journal_lines:
    description: Journal lines returned on failure.
    type: int
    default: 40
"""

EXAMPLES = r"""
# Serve, after it started or restarted a unit: its health endpoint, then one real token,
# from the unit's own process. The role reports a failure itself, with the journal lines
# the module returns, so failed_when is off here.
- name: "Health and one token: {{ serve_proc.name }}"
  gpufleet.fleet.gpufleet_ready:
    unit: "{{ serve_proc.unit }}"
    url: "{{ serve_proc.readiness.url }}"
    generate_url: "{{ serve_proc.readiness.generate_url | default(omit) }}"
    served_name: "{{ serve_proc.readiness.served_name | default(omit) }}"
    ca_file: "{{ serve_proc.readiness.ca_file | default(omit) }}"
    timeout: "{{ serve_proc.readiness.timeout_s }}"
    interval: "{{ serve_ready_delay }}"
    journal_lines: "{{ serve_journal_lines }}"
  register: __serve_ready
  failed_when: false

# fab restart, one unit at a time: it fails the play itself when the unit does not serve.
# A rank above 0 of a multi-node engine has no URL (its rank 0 answers for it).
- name: "Wait until it serves: {{ restart_one.unit }}"
  gpufleet.fleet.gpufleet_ready:
    unit: "{{ restart_one.unit }}"
    url: "{{ restart_one.readiness.url }}"
    generate_url: "{{ restart_one.readiness.generate_url | default(omit) }}"
    served_name: "{{ restart_one.readiness.served_name | default(omit) }}"
    timeout: "{{ restart_one.readiness.timeout_s }}"
  when: restart_one.readiness.url is defined
"""

RETURN = r"""
elapsed:
  description: Seconds until the unit served (health, then the generation where asked).
  type: float
  returned: success, not in check mode
  sample: 184.2
msg:
  description: >-
    In check mode, what it would wait for. On failure, what went wrong (the unit failed,
    crashed or waits to restart, another process holds the port, or the time ran out).
  type: str
  returned: failure, or in check mode
  sample: >-
    gpufleet-decode.service did not answer health at http://127.0.0.1:8002/health
    within 3600 s (last: 503)
unit_state:
  description: systemd's ActiveState, SubState, NRestarts and Result of the unit.
  type: dict
  returned: failure
  sample: {ActiveState: failed, SubState: failed, NRestarts: "3", Result: exit-code}
journal:
  description: The unit's last I(journal_lines) journal lines (journalctl -o cat).
  type: str
  returned: failure
"""

import json
import ssl
import subprocess
import time
import urllib.error
import urllib.request

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.gpufleet.fleet.plugins.module_utils.sockets import (
    strangers,
)


def unit_state(unit):
    out = subprocess.run(
        ["systemctl", "show", "-p", "ActiveState,SubState,NRestarts,Result", unit],
        capture_output=True, text=True, check=False).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def journal(unit, lines):
    return subprocess.run(
        ["journalctl", "-u", unit, "-n", str(lines), "--no-pager", "-o", "cat"],
        capture_output=True, text=True, check=False).stdout


def probe(url, body=None, timeout=10.0, context=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=context) as resp:
            return resp.status, ""
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(300).decode(errors="replace")
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, ssl.SSLCertVerificationError):
            raise  # the certificate, not the time, is what is wrong: said at once
        return None, str(exc)
    except (OSError, ValueError) as exc:
        return None, str(exc)


def release_of(url, timeout=10.0):
    """The release an engine reports ({"version": ...}), or why there is none."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return str(json.loads(resp.read(4096).decode()).get("version"))
    except (OSError, ValueError, AttributeError) as exc:
        return f"none ({exc})"


def main():
    module = AnsibleModule(
        argument_spec={
            "unit": {"type": "str", "required": True},
            "url": {"type": "str", "required": True},
            "generate_url": {"type": "str"},
            "served_name": {"type": "str"},
            "ca_file": {"type": "str"},
            "version": {"type": "str"},
            "version_url": {"type": "str"},
            "timeout": {"type": "int", "default": 600},
            "interval": {"type": "float", "default": 2},
            "journal_lines": {"type": "int", "default": 40},
        },
        supports_check_mode=True,
    )
    p = module.params
    if module.check_mode:
        module.exit_json(changed=False, msg=f"would wait for {p['unit']} at {p['url']}")
    start = time.monotonic()
    deadline = start + p["timeout"]
    stage, url, body = "health", p["url"], None
    try:
        context = ssl.create_default_context(cafile=p["ca_file"]) \
            if url.startswith("https:") else None
    except (OSError, ssl.SSLError) as exc:
        module.fail_json(msg=f"cannot read the CA file {p['ca_file']} for {url}: {exc}")
    last = ""
    restarts = unit_state(p["unit"]).get("NRestarts", "0")

    def fail(msg, state):  # with the unit's state and its last journal lines
        module.fail_json(msg=msg, unit_state=state,
                         journal=journal(p["unit"], p["journal_lines"]))

    while True:
        state = unit_state(p["unit"])
        crashed = state.get("NRestarts", "0") != restarts
        waiting = state.get("SubState") == "auto-restart"
        if crashed or waiting or state.get("ActiveState") in ("failed", "inactive"):
            what = "crashed and was restarted by systemd" if crashed else \
                "crashed and waits to be restarted (activating, auto-restart)" if waiting else \
                f"{state.get('ActiveState')} ({state.get('Result')})"
            fail(f"{p['unit']} {what} while waiting for {stage}", state)
        try:
            status, last = probe(url, body, context=context)
        except urllib.error.URLError as exc:
            fail(f"{url} serves a certificate that does not verify with "
                 f"{p['ca_file'] or 'the host trust store'}: {exc.reason.verify_message}. "
                 "Fix: give the certificate's CA (gpufleet_tls_ca_file), or a certificate "
                 "that names this host (gpufleet_tls_cert_file)", state)
        if status == 200:
            if stage == "health" and p["version_url"]:
                got = release_of(p["version_url"])
                if got != p["version"]:
                    fail(f"{p['unit']} answers, but reports release {got} at "
                         f"{p['version_url']}, not {p['version']}, the plan's: it runs "
                         "another environment. Fix: fab deploy again (it rebuilds a venv "
                         "that is not its lock's); fab logs says which program started", state)
            if stage == "generate" or not p["generate_url"]:
                others = strangers(p["unit"], p["url"])
                if others:
                    fail(f"{p['url']} answered, but not (only) from {p['unit']}: "
                         f"{'; '.join(others)}. Fix: stop what holds the port, or move "
                         "the plan's port (gpufleet_ports)", state)
                module.exit_json(changed=False, elapsed=round(time.monotonic() - start, 1))
            stage, url = "generate", p["generate_url"]
            if not url.endswith("/health_generate"):
                body = {"model": p["served_name"], "prompt": "ping", "max_tokens": 1}
            continue
        if time.monotonic() > deadline:
            fail(f"{p['unit']} did not answer {stage} at {url} within {p['timeout']} s "
                 f"(last: {status or last})", state)
        time.sleep(p["interval"])


if __name__ == "__main__":
    main()
