"""`fab status`, `fab health` and `fab acceptance` read what each host's play published
(set_stats `gpufleet_report`) from Ansible's JSON result, never a task by its name: a host
whose checker printed no JSON is a failed host whose error is the last thing it said,
never a pass and never a crash."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
from gpufleet import tasks  # noqa: E402


def report(hosts: dict) -> dict:
    return {"custom_stats": {"h9": {"other": 1},
                             **{h: {"gpufleet_report": r} for h, r in hosts.items()}},
            "stats": {h: {} for h in hosts}}


def test_each_hosts_json_or_a_failure_naming_what_it_said():
    got = tasks._host_json(report({
        "h1": {"stdout": json.dumps({"healthy": True, "checks": [{"name": "gpu"}]})},
        "h2": {"stdout": "", "stderr": "Traceback ...\nPermissionError: /dev/nvidia0\n"},
        "h3": {"msg": "non-zero return code"},
        "h4": {},
    }), "healthy")
    assert got["h1"] == {"healthy": True, "checks": [{"name": "gpu"}]}
    assert got["h2"] == {"healthy": False, "checks": [], "error": "PermissionError: /dev/nvidia0"}
    assert got["h3"]["error"] == "non-zero return code" and got["h3"]["healthy"] is False
    assert got["h4"]["error"] == "no output"
    assert "h9" not in got  # only what the hosts published for fab


def test_the_ok_key_is_the_callers():
    got = tasks._host_json(report({"h1": {"stdout": "not json"}}), "passed")
    assert got["h1"]["passed"] is False and "healthy" not in got["h1"]


BOOK = """
- hosts: all
  gather_facts: false
  tasks:
    - name: {name}
      block:
        - name: {name} | run
          ansible.builtin.command: "{{{{ cmd[inventory_hostname] }}}}"
          register: __out
          changed_when: false
          failed_when: __out.rc not in [0, 1]
      always:
        - name: {name} | publish
          ansible.builtin.set_stats:
            data:
              gpufleet_report: >-
                {{{{ __out | default({{}}) | gpufleet.fleet.gpufleet_command_report }}}}
            per_host: true
            aggregate: false
"""


@pytest.mark.parametrize("name", ["Health report | Run the checker", "renamed"])
def test_a_real_run_publishes_and_fab_reads_it_whatever_the_task_is_called(name, tmp_path):
    """ansible-playbook with fab's capture settings (tasks.JSON_RESULT): a host that
    reports, one that fails naming why, and one whose command crashes."""
    book = tmp_path / "book.yml"
    book.write_text(BOOK.format(name=name))
    cmds = {"ok": "echo '{\"healthy\": true, \"checks\": []}'",
            "sick": "sh -c 'echo \"{\\\"healthy\\\": false, \\\"checks\\\": []}\"; exit 1'",
            "crash": "python3 -c 'raise SystemExit(\"PermissionError: /dev/nvidia0\")'"}
    extra = {"cmd": cmds, "ansible_python_interpreter": sys.executable}
    run = subprocess.run(
        [str(Path(sys.executable).with_name("ansible-playbook")), "-i", "ok,sick,crash,",
         "-c", "local", str(book), "-e", json.dumps(extra)],
        env={**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), **tasks.JSON_RESULT},
        capture_output=True, text=True, timeout=120, check=False)
    got = tasks._host_json(json.loads(run.stdout), "healthy")
    assert got == {"ok": {"healthy": True, "checks": []},
                   "sick": {"healthy": False, "checks": []},
                   "crash": {"healthy": False, "checks": [],
                             "error": "PermissionError: /dev/nvidia0"}}, run.stderr


def test_importing_the_tasks_leaves_python_its_own_closed_pipe_handling():
    """Only the fab program dies quietly on a closed pipe (`fab targets | head -1`): a
    process that imports the tasks (this test run) must see a closed pipe as an error, or
    the first test that writes to one kills the whole run (exit 141)."""
    import signal

    assert signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN
