"""hosts[*].engine.python and .lock: the lock for the host's CPU architecture and Python,
and the planner's refusal of a host Python no lock was made for."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gpufleet import inventory, rules
from gpufleet.catalog import lockfile
from gpufleet.plan import PlanError, make_plan

REPO = Path(__file__).resolve().parents[2]


def with_python(groups: dict[str, int], python) -> inventory.Inventory:
    inv = inventory.placeholder(groups)
    for name, host in inv.hosts.items():
        inv.hosts[name] = inventory.Host(name, host.address, {"gpufleet_host_python": python})
    return inv


@pytest.mark.parametrize(("target", "lock"), [
    ("h200-pd-1node", "vllm-x86_64-py312.txt"),
    ("gb200-tray", "vllm-aarch64-py312.txt"),         # Grace trays are aarch64
    ("sglang-gb300-low-latency", "sglang-aarch64-py312.txt"),
    ("h200-disagg", "dynamo-x86_64-py312.txt"),
])
def test_default_python_picks_the_lock_for_the_hardware_arch(target, lock):
    plan = make_plan(target)
    for host in plan.to_json()["hosts"].values():
        engine = host["engine"]
        assert engine["python"] == "3.12"
        assert engine["lock"] == f"gpufleet/catalog/locks/{lock}"
        assert (REPO / engine["lock"]).is_file()
        assert engine["glibc_floor"] == lockfile.read(REPO / engine["lock"]).one("glibc")
        assert "pins" not in engine and "packages" not in engine  # the lock says what installs


def test_inventory_python_picks_its_lock():
    plan = make_plan("h200-pd-1node", with_python({"workers": 1}, "3.11"))
    engine = plan.to_json()["hosts"]["workers-1"]["engine"]
    assert engine["python"] == "3.11"
    assert engine["lock"].endswith("/vllm-x86_64-py311.txt")


@pytest.mark.parametrize("python", ["3.13", 3.1])  # 3.1: an unquoted 3.10 in YAML
def test_host_python_without_a_lock_is_refused(python):
    with pytest.raises(PlanError) as exc:
        make_plan("h200-pd-1node", with_python({"workers": 1}, python))
    (problem,) = [p for p in exc.value.problems if "gpufleet_host_python" in p.field]
    assert problem.field == "hosts.workers-1.gpufleet_host_python"
    assert f"CPython '{python}' on x86_64" in problem.message
    assert "3.12, 3.11" in problem.message
    assert 'gpufleet_host_python: "3.12"' in problem.fix and "scripts/lock" in problem.fix
    assert "--runtime image" in problem.fix


def test_a_host_python_without_a_lock_runs_the_engine_from_its_image():
    """Ubuntu 22.04's Python 3.10 has no venv lock: the image brings its own Python."""
    plan = make_plan("h200-pd-1node", with_python({"workers": 1}, "3.10"), {"runtime": "image"})
    assert plan.to_json()["hosts"]["workers-1"]["engine"]["runtime"] == "image"


def test_amd_hosts_have_no_cuda_lock_and_say_so(monkeypatch):
    venv = {"runtime": "venv"}
    with pytest.raises(PlanError, match="no ROCm build of sglang 0.5.23"):
        make_plan("sglang-mi355x-low-latency", overrides=venv)  # refused whole: test_rules
    monkeypatch.setattr(rules, "RULES",
                        [r for r in rules.RULES if r is not rules.venv_runtime_needs_nvidia])
    plan = make_plan("sglang-mi355x-low-latency", overrides=venv)
    assert all(h["engine"]["lock"] is None for h in plan.to_json()["hosts"].values())
    assert any("CUDA builds" in w and "MI355X" in w for w in plan.warnings)


def test_lab_hosts_declare_debian_12_python():
    lab = yaml.safe_load((REPO / "inventories/lab/group_vars/all.yml").read_text())
    assert lab["gpufleet_host_python"] == "3.11"  # a string: 3.10 would read as 3.1
    sample = (REPO / "inventories/sample/group_vars/all.yml").read_text()
    assert "gpufleet_host_python" in sample
