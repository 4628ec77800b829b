"""The product works without the lab: the package `gpufleet` holds and imports nothing of
lab/, and the task collection without lab/ beside it still has every product task and no
`lab.*` (a site's checkout or install of gpufleet need not carry the lab)."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PRODUCT_TASKS = {"targets", "plan", "deploy", "endpoint", "bench", "prepare", "cache", "smoke",
                 "status", "logs", "restart", "teardown", "health"}
LAB_TASKS = {"lab.up", "lab.status", "lab.down", "lab.reboot", "lab.ssh"}


def _lab_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        found += [f"{path.relative_to(REPO)}:{node.lineno} imports {n}" for n in names
                  if n.split(".")[0] == "gpufleet_lab" or n.startswith("gpufleet.lab")]
    return found


def test_the_package_holds_and_imports_nothing_of_the_lab():
    assert not (REPO / "gpufleet" / "lab").exists(), "the lab belongs in lab/, not the package"
    found = [hit for py in sorted((REPO / "gpufleet").rglob("*.py")) for hit in _lab_imports(py)]
    # the one exception: the fab program adds `fab lab.*` in a checkout that has lab/
    # (IN_CHECKOUT; an installed package never gets there, the test below proves it)
    hook = [h for h in found if h.startswith("gpufleet/tasks.py:") and
            h.endswith("imports gpufleet_lab.tasks")]
    assert len(hook) == 1, found
    found.remove(hook[0])
    assert not found, "the product must not depend on the lab (lab/):\n" + "\n".join(found)


def _fab_list(package_parent: Path, cwd: Path) -> set[str]:
    """The tasks the fab program lists with the package gpufleet imported from
    PACKAGE_PARENT (ahead of the editable install)."""
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
           "PYTHONPATH": str(package_parent)}
    out = subprocess.run([sys.executable, "-c", "from gpufleet.tasks import main; main()",
                          "--list", "--list-format=json"], cwd=cwd, env=env,
                         capture_output=True, text=True, check=True).stdout
    ns = json.loads(out)
    return ({t["name"] for t in ns["tasks"]}
            | {f"{c['name']}.{t['name']}" for c in ns["collections"] for t in c["tasks"]})


def test_an_installed_package_has_the_product_tasks_and_no_lab(tmp_path):
    """The package alone, as a wheel installs it (no checkout around it): every product
    task, no lab.*, and nothing of the lab importable or imported."""
    shutil.copytree(REPO / "gpufleet", tmp_path / "site" / "gpufleet",
                    ignore=shutil.ignore_patterns("__pycache__"))
    code = ("import importlib.util, sys\n"
            "assert importlib.util.find_spec('gpufleet_lab') is None, 'the lab is importable'\n"
            "import gpufleet.bench, gpufleet.catalog, gpufleet.cli, gpufleet.inventory\n"
            "import gpufleet.overrides, gpufleet.plan, gpufleet.rules, gpufleet.smoke\n"
            "import gpufleet.tasks as t\n"
            f"assert t.__file__.startswith({str(tmp_path / 'site')!r}), t.__file__\n"
            "assert not t.IN_CHECKOUT and t.DEFAULT_INVENTORY == ''\n"
            "assert not [m for m in sys.modules if m.startswith('gpufleet_lab')]\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path,
                   env={**env, "PYTHONPATH": str(tmp_path / "site")}, check=True)
    names = _fab_list(tmp_path / "site", tmp_path)
    assert names >= PRODUCT_TASKS, names
    assert not {n for n in names if n.startswith("lab.")}, names


def test_the_checkout_adds_lab_tasks_from_any_directory(tmp_path):
    names = _fab_list(REPO, tmp_path)
    assert names >= PRODUCT_TASKS | LAB_TASKS, names
