"""`fab health` and `fab acceptance` read each host's JSON report from Ansible's JSON
callback output the same way: a host whose checker printed no JSON is a failed host whose
error is the last thing it said, never a pass and never a crash."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("gpufleet_fab_tasks", REPO / "tasks.py")
tasks = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tasks)

TASK = "Health report | Run the checker"


def report(hosts: dict) -> dict:
    return {"plays": [{"tasks": [{"task": {"name": "Something else"}, "hosts": {"h9": {}}},
                                 {"task": {"name": TASK}, "hosts": hosts}]}],
            "stats": {h: {} for h in hosts}}


def test_each_hosts_json_or_a_failure_naming_what_it_said():
    got = tasks._host_json(report({
        "h1": {"stdout": json.dumps({"healthy": True, "checks": [{"name": "gpu"}]})},
        "h2": {"stdout": "", "stderr": "Traceback ...\nPermissionError: /dev/nvidia0\n"},
        "h3": {"msg": "non-zero return code"},
        "h4": {},
    }), TASK, "healthy")
    assert got["h1"] == {"healthy": True, "checks": [{"name": "gpu"}]}
    assert got["h2"] == {"healthy": False, "checks": [], "error": "PermissionError: /dev/nvidia0"}
    assert got["h3"]["error"] == "non-zero return code" and got["h3"]["healthy"] is False
    assert got["h4"]["error"] == "no output"
    assert "h9" not in got  # only the named task's hosts


def test_the_ok_key_is_the_callers():
    got = tasks._host_json(report({"h1": {"stdout": "not json"}}), TASK, "passed")
    assert got["h1"]["passed"] is False and "healthy" not in got["h1"]


def test_importing_the_tasks_leaves_python_its_own_closed_pipe_handling():
    """Only the fab program dies quietly on a closed pipe (`fab targets | head -1`): a
    process that imports the tasks (this test run) must see a closed pipe as an error, or
    the first test that writes to one kills the whole run (exit 141)."""
    import signal

    assert signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN
