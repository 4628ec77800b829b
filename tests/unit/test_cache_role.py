"""roles/cache on the fetching host's Python: it installs the huggingface_hub release
that Python can run (2.x needs 3.10) and refuses one older than the oldest Python
scripts/host-pythons tests the host programs with; the health role's minimum is the same.
The role's preflight tasks run for real with ansible-playbook on localhost."""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
PLAYBOOK = Path(sys.executable).with_name("ansible-playbook")
PLAY = [{
    "hosts": "localhost", "connection": "local", "gather_facts": False,
    "vars": {"gpufleet_host": {"name": "localhost", "plan_hosts": ["localhost"],
                               "checkpoint": {"path": "/tmp/gpufleet-cache-role-test",
                                              "models": [{"repo": "zai-org/GLM-5.3-Flash"}]}}},
    "tasks": [{"ansible.builtin.include_role": {"name": "gpufleet.fleet.cache",
                                                "tasks_from": "preflight.yml"}},
              {"ansible.builtin.debug": {"msg": "hub={{ __cache_hf_hub_versions['localhost'] }}"}}],
}]
DEFAULTS = yaml.safe_load((REPO / "roles" / "cache" / "defaults" / "main.yml").read_text())


def version_key(v: str) -> tuple:
    return tuple(int(x) for x in v.split("."))


def pythons_tested() -> list:
    text = (REPO / "scripts" / "host-pythons").read_text()
    listed = re.search(r"HOST_PYTHONS:-([0-9. ]+)\}", text).group(1).split()
    return sorted(listed + ["3.11"], key=version_key)  # 3.11: the controller's own run


def minimum(path: str) -> list:
    return re.findall(r"is version\('([0-9.]+)', '>='\)", (REPO / path).read_text())


def interpreter(version: str) -> str:
    root = os.environ.get("HOST_PYTHONS_DIR", "/root/.pyenv/versions")
    found = sorted(glob.glob(f"{root}/{version}.*/bin/python"))
    if not found:
        pytest.fail(f"no Python {version} under {root}. Fix: install it (pyenv install {version}) "
                    "or set HOST_PYTHONS_DIR", pytrace=False)
    return found[0]


def run_preflight(tmp_path: Path, python: str) -> subprocess.CompletedProcess:
    play = tmp_path / "play.yml"
    play.write_text(json.dumps(PLAY))
    env = dict(os.environ, ANSIBLE_COLLECTIONS_PATH=str(REPO / "collections"), ANSIBLE_NOCOLOR="1",
               ANSIBLE_LOCALHOST_WARNING="0")
    return subprocess.run([str(PLAYBOOK), "-i", "localhost,", str(play),
                           "-e", f"ansible_python_interpreter={sys.executable}",
                           "-e", f"cache_python={python}"],
                          env=env, capture_output=True, text=True, timeout=120)


def test_the_preflights_accept_exactly_the_pythons_that_are_tested():
    lowest = pythons_tested()[0]
    assert pythons_tested() == ["3.8", "3.9", "3.10", "3.11", "3.12", "3.13"]
    assert minimum("roles/cache/tasks/preflight.yml") == [lowest]
    assert minimum("roles/health/tasks/preflight.yml") == [lowest]
    # every tested Python below 3.10 has a hub release of its own (2.x needs 3.10)
    older = [v for v in pythons_tested() if version_key(v) < (3, 10)]
    assert sorted(DEFAULTS["cache_hf_hub_version_by_python"], key=version_key) == older
    assert all(v.startswith("0.") for v in DEFAULTS["cache_hf_hub_version_by_python"].values())


@pytest.mark.parametrize("version", ["3.8", "3.11"])
def test_the_hub_release_follows_the_fetching_hosts_python(tmp_path, version):
    python = sys.executable if version == "3.11" else interpreter(version)
    proc = run_preflight(tmp_path, python)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    want = {"3.8": "0.36.2", "3.11": DEFAULTS["cache_hf_hub_version"]}[version]
    picked = re.search(r'msg"?: "?hub=([^"\s]+)', proc.stdout)
    assert picked and picked.group(1) == want, proc.stdout


def test_a_python_older_than_3_8_is_refused_with_the_fix(tmp_path):
    proc = run_preflight(tmp_path, interpreter("3.7"))
    assert proc.returncode != 0
    out = " ".join(proc.stdout.split())
    assert "is Python 3.7, older than 3.8" in out and "set cache_python" in out, out
    proc = run_preflight(tmp_path, str(tmp_path / "no-python"))
    assert proc.returncode != 0 and "is not runnable (exit" in " ".join(proc.stdout.split())
