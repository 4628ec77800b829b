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
    assert not found, "the product must not depend on the lab (lab/):\n" + "\n".join(found)


def _fab_list(cwd: Path) -> set[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([str(Path(sys.executable).with_name("fab")), "--list",
                          "--list-format=json"], cwd=cwd, env=env, capture_output=True,
                         text=True, check=True).stdout
    ns = json.loads(out)
    return ({t["name"] for t in ns["tasks"]}
            | {f"{c['name']}.{t['name']}" for c in ns["collections"] for t in c["tasks"]})


def test_tasks_without_the_lab_have_the_product_and_no_lab_tasks(tmp_path):
    for name in ("tasks.py", "fabfile.py"):
        shutil.copy(REPO / name, tmp_path)
    # the controller's modules load with the lab unreachable, and load none of it
    code = ("import importlib.util, sys\n"
            "assert importlib.util.find_spec('gpufleet_lab') is None, 'the lab is importable'\n"
            "import gpufleet.bench, gpufleet.catalog, gpufleet.cli, gpufleet.inventory\n"
            "import gpufleet.overrides, gpufleet.plan, gpufleet.rules, gpufleet.smoke, tasks\n"
            f"assert tasks.__file__ == {str(tmp_path / 'tasks.py')!r}, tasks.__file__\n"
            "assert not [m for m in sys.modules if m.startswith('gpufleet_lab')]\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, check=True)
    names = _fab_list(tmp_path)
    assert names >= PRODUCT_TASKS, names
    assert not {n for n in names if n.startswith("lab.")}, names


def test_tasks_with_the_lab_add_lab_tasks():
    names = _fab_list(REPO)
    assert names >= PRODUCT_TASKS | LAB_TASKS, names
