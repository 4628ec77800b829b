"""gpufleet as a site installs it, with no checkout: the wheel in a fresh virtual environment
and the collection gpufleet.fleet from its tarball, then `fab plan` and `fab deploy` onto the
lab from another directory with an inventory there, and a playbook of the site's own that
uses a role by its full name converging a lab host. Slow (a fresh environment from the
package index, then a deploy); the checkout's own deploy of the same target runs in the
default run (test_deploy.py)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
from labutil import BIN, ROOT, recap, ssh

pytestmark = pytest.mark.slow
TARGET = "h200-pd-1node"

OWN_PLAYBOOK = """
- name: The deployment's plan, from the inventory
  ansible.builtin.import_playbook: gpufleet.fleet.plan

- name: The site's own play with gpufleet's health role
  hosts: gpufleet_planned
  become: true
  gather_facts: false
  roles:
    - gpufleet.fleet.health
"""


def run(argv, cwd, env, timeout=900):
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)
    assert proc.returncode == 0, (argv, proc.stdout[-4000:], proc.stderr[-3000:])
    return proc


def test_the_wheel_and_the_collection_deploy_from_another_directory(lab, tmp_path):
    dist, venv, site = tmp_path / "dist", tmp_path / "venv", tmp_path / "site"
    # the operator's environment: nothing of the checkout, the lab's or the test's
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ANSIBLE_", "PYTHONPATH", "VIRTUAL_ENV"))}
    env["PATH"] = f"{venv / 'bin'}:{env.get('PATH', '')}"
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    env["ANSIBLE_COLLECTIONS_PATH"] = str(tmp_path / "collections")
    run([str(BIN / "pip"), "wheel", "-q", "--no-deps", "-w", str(dist), str(ROOT)], tmp_path,
        env)
    run([str(BIN / "ansible-galaxy"), "collection", "build", "--output-path", str(dist),
         str(ROOT)], tmp_path, env)
    wheel = next(dist.glob("gpufleet-*.whl"))
    tarball = next(dist.glob("gpufleet-fleet-*.tar.gz"))
    run([sys.executable, "-m", "venv", str(venv)], tmp_path, env)
    run([str(venv / "bin" / "pip"), "install", "-q", "-c", str(ROOT / "constraints.txt"),
         str(wheel)], tmp_path, env)
    run([str(venv / "bin" / "ansible-galaxy"), "collection", "install", "-p",
         env["ANSIBLE_COLLECTIONS_PATH"], str(tarball)], tmp_path, env)
    # the package is the wheel's, not the checkout's
    where = run([str(venv / "bin" / "python"), "-c",
                 "import gpufleet.tasks as t; print(t.__file__, t.IN_CHECKOUT)"], tmp_path, env)
    assert where.stdout.startswith(str(venv)) and where.stdout.split()[-1] == "False"

    # the operator's directory, with the inventory (the lab's, copied)
    shutil.copytree(ROOT / "inventories" / "lab", site / "inventory")
    fab = str(venv / "bin" / "fab")
    listed = run([fab, "--list"], site, env)
    assert "deploy" in listed.stdout and "lab." not in listed.stdout
    plan = run([fab, "plan", "-i", "inventory", "--target", TARGET], site, env)
    assert "gpufleet-prefill.service" in plan.stdout
    deploy = run([fab, "deploy", "-i", "inventory", "--target", TARGET], site, env,
                 timeout=1500)
    assert "endpoint: https://10.213.77.11:8000/v1" in deploy.stdout
    # the smoke test ran and passed: its results table, then its last task
    assert re.search(r"^\s*- models\s+ok\b", deploy.stdout, re.M), deploy.stdout[-3000:]
    assert "TASK [Smoke | All checks passed]" in deploy.stdout, deploy.stdout[-3000:]

    # a playbook of the site's own, the role by its full name: the health timer, stopped
    # and disabled by hand, is converged back, then a second run changes nothing
    ssh("lab1", "systemctl disable --now gpufleet-health.timer")
    (site / "mine.yml").write_text(OWN_PLAYBOOK)
    playbook = str(venv / "bin" / "ansible-playbook")
    first = run([playbook, "-i", "inventory", "mine.yml"], site, env)
    assert recap(first.stdout)["lab1"]["changed"] > 0, first.stdout[-3000:]
    assert ssh("lab1", "systemctl is-enabled gpufleet-health.timer; "
                       "systemctl is-active gpufleet-health.timer").split() == [
        "enabled", "active"]
    again = run([playbook, "-i", "inventory", "mine.yml"], site, env)
    assert recap(again.stdout)["lab1"]["changed"] == 0, again.stdout[-3000:]
