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
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
EE = ROOT / "execution-environment.yml"


def pins() -> dict[str, str]:
    """constraints.txt: name -> the exact version."""
    found = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = re.fullmatch(r"([\w.-]+)==([\w.]+)", line.strip()).groups()
            found[name] = version
    return found


def test_every_dependency_is_pinned_within_its_range():
    """pyproject.toml states ranges, constraints.txt the versions tested: one pin per
    dependency (runtime and dev), each inside its range, and nothing else pinned."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = [Requirement(s) for s in project["dependencies"]
             + project["optional-dependencies"]["dev"]]
    want = pins()
    assert {canonicalize_name(r.name) for r in specs} == {canonicalize_name(n) for n in want}
    for req in specs:
        version = want[next(n for n in want if canonicalize_name(n) ==
                            canonicalize_name(req.name))]
        assert req.specifier.contains(version), f"{req.name}=={version} is outside {req}"
    assert any(not str(r.specifier).startswith("==") for r in specs)  # ranges, not pins


def test_the_ee_pins_what_the_project_pins():
    ee = yaml.safe_load(EE.read_text())
    deps = ee["dependencies"]
    want = pins()
    assert deps["ansible_core"]["package_pip"] == f"ansible-core=={want['ansible-core']}"
    assert deps["ansible_runner"]["package_pip"] == f"ansible-runner=={want['ansible-runner']}"
    # gpufleet's own dependencies come from pyproject.toml, installed with it: one place
    assert "python" not in deps and "galaxy" not in deps
    sources = {f["src"] for f in ee["additional_build_files"]}
    assert {"pyproject.toml", "constraints.txt", "gpufleet"} <= sources


def test_ansible_builder_makes_a_build_context_that_installs_gpufleet(tmp_path):
    ctx = tmp_path / "context"
    proc = subprocess.run([str(Path(sys.executable).with_name("ansible-builder")), "create",
                           "-f", str(EE), "-c", str(ctx), "--output-filename", "Containerfile"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    containerfile = (ctx / "Containerfile").read_text()
    assert 'ARG PYCMD="/usr/bin/python3.11"' in containerfile
    assert "COPY _build/src /tmp/gpufleet-src" in containerfile
    assert "$PYCMD -m pip install --no-cache-dir -c /tmp/gpufleet-src/constraints.txt " \
        "/tmp/gpufleet-src" in containerfile
    # installed as root, before the image drops to its unprivileged user
    assert containerfile.index("/tmp/gpufleet-src &&") < containerfile.rindex("USER 1000")
    src = ctx / "_build" / "src"
    assert (src / "pyproject.toml").read_bytes() == (ROOT / "pyproject.toml").read_bytes()
    assert (src / "constraints.txt").read_bytes() == (ROOT / "constraints.txt").read_bytes()
    assert (src / "gpufleet" / "plan.py").is_file()
    assert (src / "gpufleet" / "catalog" / "targets.yml").is_file()
    assert "openssh-clients [platform:rpm]" in (ctx / "_build" / "bindep.txt").read_text()
    # under ansible-runner, gpufleet's callback (progress lines) wraps runner's
    assert "ENV ANSIBLE_STDOUT_CALLBACK=gpufleet.fleet.gpufleet" in containerfile
    assert (ROOT / "plugins/callback/gpufleet.py").is_file()

