"""Drift: what the roles manage, changed on a deployed host behind gpufleet's back.

A re-run where nothing changed runs each role's one-task check (gpufleet_state) and
nothing else; a run after someone edited a unit file, an environment file or a config,
changed a package in the engine venv, stopped a service or loosened a file's mode and
owner repairs every one of them (changed > 0, each role naming what drifted), and the
run after that changes nothing.
"""

from __future__ import annotations

import json
import re
import secrets
from pathlib import Path

import pytest
from labutil import changed_tasks, fab, playbook, recap, ssh

pytestmark = pytest.mark.lab

TARGET = "h200-pd-1node"
VENV = "/opt/gpufleet/engines/vllm-0.33.0"
ENV = "/etc/gpufleet/env"


def site() -> str:
    proc = playbook("-i", "inventories/lab", "site.yml", "-e", f"gpufleet_target={TARGET}")
    assert proc.returncode == 0, proc.stdout[-4000:]
    return proc.stdout


def converged_roles(output: str) -> list[str]:
    """Roles whose converge.yml ran (their check found a change or drift)."""
    return re.findall(r"^included: .*/roles/(\w+)/tasks/converge\.yml for lab1", output, re.M)


def a_locked_package() -> str:
    found = ssh("lab1", f"ls -d {VENV}/lib/python3*/site-packages/*.dist-info").split()
    names = [p.rsplit("/", 1)[1].split("-")[0] for p in found]
    for name in ("idna", "certifi", "six", "packaging", "charset_normalizer"):
        if name in names:
            return name
    pytest.fail(f"no small package to remove in {VENV}: {names}", pytrace=False)


@pytest.fixture(scope="module")
def deployed(lab):
    proc = fab("deploy", "--target", TARGET)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_a_noop_runs_only_each_roles_check(deployed):
    out = site()
    assert recap(out)["lab1"]["changed"] == 0, changed_tasks(out, "lab1")
    assert converged_roles(out) == [], converged_roles(out)
    # every role that applies to the host asked its one question
    checked = set(re.findall(r"^TASK \[gpufleet\.fleet\.(\w+) : [^]]*Converged, nothing drifted\?",
                             out, re.M))
    assert {"nvidia_driver", "ucx", "engine_runtime", "cache", "serve", "health"} <= checked


@pytest.mark.slow  # about 95 s; test_deploy's changed flag repairs one kind in every run
def test_every_kind_of_drift_is_repaired_then_the_next_run_changes_nothing(deployed):
    package = a_locked_package()
    version = ssh("lab1", f"{VENV}/bin/python -m pip show {package} | sed -n 's/^Version: //p'"
                  ).strip()
    ssh("lab1", " && ".join([
        "echo '# edited by hand' >> /etc/systemd/system/gpufleet-decode.service",
        f"echo 'DRIFT=1' >> {ENV}/prefill.env",
        "echo '{}' > /etc/gpufleet/health.json",
        f"{VENV}/bin/python -m pip uninstall -y -q {package}",
        "systemctl stop gpufleet-router.service",
        f"chmod 0644 {ENV}/decode.env && chown root:root {ENV}/decode.env",
    ]), check=True)

    out = site()
    said = " ".join(out.split())
    assert recap(out)["lab1"]["changed"] > 0
    assert {"engine_runtime", "serve", "health"} <= set(converged_roles(out)), said[-3000:]
    # each check names what drifted
    for reason in ("gpufleet-decode.service changed (sha256)",
                   f"{ENV}/prefill.env changed (sha256)",
                   f"{ENV}/decode.env changed (gid, mode)",
                   "gpufleet-router.service is inactive",
                   "/etc/gpufleet/health.json changed (sha256)",
                   f"{VENV}: {package}-{version}"):
        assert reason in said, (reason, said[-3000:])
    # and everything is back
    assert "edited by hand" not in ssh("lab1", "cat /etc/systemd/system/gpufleet-decode.service")
    assert "DRIFT" not in ssh("lab1", f"cat {ENV}/prefill.env")
    assert ssh("lab1", f"stat -c '%a %U %G' {ENV}/decode.env").split() == \
        ["640", "root", "gpufleet"]
    assert ssh("lab1", "systemctl is-active gpufleet-router.service").strip() == "active"
    assert '"units"' in ssh("lab1", "cat /etc/gpufleet/health.json")
    assert ssh("lab1", f"{VENV}/bin/python -m pip show {package} | sed -n 's/^Version: //p'"
               ).strip() == version

    again = site()
    assert recap(again)["lab1"]["changed"] == 0, changed_tasks(again, "lab1")
    assert converged_roles(again) == []


def test_a_rotated_api_key_reaches_the_gateway(deployed):
    """The key lives on the controller, outside every file the host records: rotating it
    is still a change the serve role sees and applies (the smoke test then uses it)."""
    key_file = json.loads(fab("plan", "--target", TARGET, "-i", "inventories/lab", "--format",
                              "json").stdout)["api"]["key_file"]
    old = Path(key_file).read_text()
    Path(key_file).write_text(secrets.token_hex(24))
    try:
        out = site()
        assert "serve" in converged_roles(out)
        assert "this run's facts differ: api_key" in " ".join(out.split())
        conf = ssh("lab1", "cat /etc/gpufleet/gateway/api-key.conf")
        assert Path(key_file).read_text() in conf and old not in conf
    finally:
        Path(key_file).write_text(old)
    assert "serve" in converged_roles(site())  # and back
