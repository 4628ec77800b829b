"""The execution environment AWX / Ansible Automation Platform run gpufleet in
(execution-environment.yml): ansible-builder accepts it, and it carries exactly the
versions the project pins and gpufleet itself."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
EE = ROOT / "execution-environment.yml"


def pins() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found = {}
    for spec in project["dependencies"] + project["optional-dependencies"]["dev"]:
        name, version = re.fullmatch(r"([\w.-]+)==([\w.]+)", spec.split("#")[0].strip()).groups()
        found[name] = version
    return found


def test_the_ee_pins_what_the_project_pins():
    ee = yaml.safe_load(EE.read_text())
    deps = ee["dependencies"]
    want = pins()
    assert deps["ansible_core"]["package_pip"] == f"ansible-core=={want['ansible-core']}"
    assert deps["ansible_runner"]["package_pip"] == f"ansible-runner=={want['ansible-runner']}"
    # gpufleet's own dependencies come from pyproject.toml, installed with it: one place
    assert "python" not in deps and "galaxy" not in deps
    sources = {f["src"] for f in ee["additional_build_files"]}
    assert {"pyproject.toml", "gpufleet"} <= sources


def test_ansible_builder_makes_a_build_context_that_installs_gpufleet(tmp_path):
    ctx = tmp_path / "context"
    proc = subprocess.run([str(Path(sys.executable).with_name("ansible-builder")), "create",
                           "-f", str(EE), "-c", str(ctx), "--output-filename", "Containerfile"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    containerfile = (ctx / "Containerfile").read_text()
    assert 'ARG PYCMD="/usr/bin/python3.11"' in containerfile
    assert "COPY _build/src /tmp/gpufleet-src" in containerfile
    assert "$PYCMD -m pip install --no-cache-dir /tmp/gpufleet-src" in containerfile
    # installed as root, before the image drops to its unprivileged user
    assert containerfile.index("/tmp/gpufleet-src &&") < containerfile.rindex("USER 1000")
    src = ctx / "_build" / "src"
    assert (src / "pyproject.toml").read_bytes() == (ROOT / "pyproject.toml").read_bytes()
    assert (src / "gpufleet" / "plan.py").is_file()
    assert (src / "gpufleet" / "catalog" / "targets.yml").is_file()
    assert "openssh-clients [platform:rpm]" in (ctx / "_build" / "bindep.txt").read_text()
