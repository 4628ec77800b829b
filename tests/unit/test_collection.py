"""gpufleet as the Ansible collection gpufleet.fleet (galaxy.yml): it builds with
ansible-galaxy, installs, and a site's own playbook outside the checkout uses it by full
names, its lookup planning with gpufleet's Python package and its module running with its
module_utils. Its version is the Python package's. The checkout's plays call the same
names (ansible.cfg's collections_path reaches the checkout through collections/)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
GALAXY = yaml.safe_load((ROOT / "galaxy.yml").read_text())

PLAY = """
- name: A site's own play with gpufleet's collection
  hosts: node1
  gather_facts: false
  tasks:
    - name: The plan, through the collection's lookup
      ansible.builtin.debug:
        msg: "{{ lookup('gpufleet.fleet.gpufleet_plan', 'h200-pd-1node').target }}"
    - name: A module of the collection, with its module_utils
      gpufleet.fleet.gpu_facts:
      register: facts
    - name: What it found
      ansible.builtin.debug:
        msg: "{{ facts.ansible_facts.keys() | sort | join(',') }}"
"""

ROLES_PLAY = """
- name: The collection's plan
  ansible.builtin.import_playbook: gpufleet.fleet.plan
- name: The collection's roles by full name, each on its host's slice of the plan
  hosts: gpufleet_planned
  become: true
  roles:
    - gpufleet.fleet.nvidia_driver
    - gpufleet.fleet.serve
"""


def test_the_collection_is_the_python_packages_version():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert (GALAXY["namespace"], GALAXY["name"]) == ("gpufleet", "fleet")
    assert GALAXY["version"] == project["version"]


def test_the_checkout_reaches_itself_as_the_collection():
    link = ROOT / "collections" / "ansible_collections" / "gpufleet" / "fleet"
    assert link.is_symlink() and link.resolve() == ROOT
    for kind in ("modules", "module_utils", "lookup", "filter", "callback"):
        assert (ROOT / "plugins" / kind).is_dir(), kind


def test_built_installed_and_used_from_outside_the_checkout(tmp_path):
    built = subprocess.run([str(BIN / "ansible-galaxy"), "collection", "build", "-f",
                            "--output-path", str(tmp_path), str(ROOT)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    tarball = tmp_path / f"gpufleet-fleet-{GALAXY['version']}.tar.gz"
    with tarfile.open(tarball) as tar:
        names = set(tar.getnames())
    assert {"galaxy.yml", "MANIFEST.json"} - names == {"galaxy.yml"}  # MANIFEST replaces it
    assert {"roles/serve/tasks/main.yml", "playbooks/site.yml", "plugins/modules",
            "gpufleet/ansible_plugins/modules/gpufleet_pool.py"} <= names
    assert not any(n.startswith(("lab/", "tests/", "collections/", ".venv")) for n in names)

    # from outside the checkout, whose ansible.cfg already reaches the collection
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    installed = tmp_path / "collections"
    inst = subprocess.run([str(BIN / "ansible-galaxy"), "collection", "install", "-p",
                           str(installed), str(tarball)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert inst.returncode == 0, inst.stdout + inst.stderr
    assert (installed / "ansible_collections/gpufleet/fleet/plugins/modules/gpu_facts.py").is_file()

    site = tmp_path / "site"  # the operator's directory: no ansible.cfg, no checkout
    site.mkdir()
    (site / "inventory.yml").write_text(
        "all:\n  children:\n    workers:\n      hosts:\n        node1:\n"
        "          ansible_connection: local\n"
        f"          ansible_python_interpreter: {sys.executable}\n"
        "  vars: {gpufleet_hardware: h200}\n")
    (site / "mine.yml").write_text(PLAY)
    (site / "roles.yml").write_text(ROLES_PLAY)
    env["ANSIBLE_COLLECTIONS_PATH"] = str(installed)
    run = subprocess.run([str(BIN / "ansible-playbook"), "-i", "inventory.yml", "mine.yml"],
                         cwd=site, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert '"msg": "h200-pd-1node"' in run.stdout
    assert "gpufleet_gpu,gpufleet_ib,gpufleet_machine" in run.stdout
    check = subprocess.run([str(BIN / "ansible-playbook"), "-i", "inventory.yml", "roles.yml",
                            "--syntax-check"], cwd=site, capture_output=True, text=True,
                           timeout=300, env=env)
    assert check.returncode == 0, check.stdout + check.stderr

    # the fab program of an installed package (no checkout around it) runs the installed
    # collection's playbooks, from the operator's directory, with the operator's inventory
    package = tmp_path / "site-packages"
    shutil.copytree(ROOT / "gpufleet", package / "gpufleet",
                    ignore=shutil.ignore_patterns("__pycache__"))
    env["PYTHONPATH"] = str(package)
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")

    def fab(*args):
        return subprocess.run([sys.executable, "-c", "from gpufleet.tasks import main; main()",
                               *args], cwd=site, env=env, capture_output=True, text=True,
                              timeout=300)

    status = fab("status", "-i", "inventory.yml", "--target", "h200-pd-1node", "--format",
                 "json")
    units = json.loads(status.stdout or "{}").get("units")
    assert units and {u["host"] for u in units} == {"node1"}, status.stdout + status.stderr
    assert (tmp_path / "cache" / "gpufleet" / "ansible-facts").is_dir()
    no_inventory = fab("status", "--target", "h200-pd-1node")
    assert no_inventory.returncode == 2 and "pass -i PATH" in no_inventory.stderr
    manifest = installed / "ansible_collections/gpufleet/fleet/MANIFEST.json"
    data = json.loads(manifest.read_text())
    data["collection_info"]["version"] = "0.0.1"
    manifest.write_text(json.dumps(data))
    other = fab("status", "-i", "inventory.yml", "--target", "h200-pd-1node")
    assert other.returncode == 2 and "is version 0.0.1" in other.stderr, other.stderr
    assert "(or pip install gpufleet==0.0.1)" in other.stderr, other.stderr
    manifest.unlink()
    env["ANSIBLE_COLLECTIONS_PATH"] = str(tmp_path / "nothing")
    missing = fab("status", "-i", "inventory.yml", "--target", "h200-pd-1node")
    assert missing.returncode == 2 and "ansible-galaxy collection install" in missing.stderr, \
        missing.stderr
