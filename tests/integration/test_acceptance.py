"""fab acceptance on the lab: the playbook, the program in the engine venv (its PyTorch is
the lab's stand-in on the simulated GPUs), the report and the deploy's gate, with the
faults an operator meets: NVLink links down, GPU memory that reads back wrong, a hung
collective. Runs after the modules that leave h200-pd-1node serving on lab1 (prefill on
GPUs 0-3, decode on 4-7) and leaves it serving again."""

from __future__ import annotations

import json
import re
import time

import pytest
from labutil import fab, playbook, recap, ssh

pytestmark = pytest.mark.lab

TARGET = ("--target", "h200-pd-1node")
ENGINES = "gpufleet-prefill.service gpufleet-decode.service"


def inject(faults: dict | None):
    path = "/var/lib/gpufleet-lab/gpu-faults.json"
    ssh("lab1", f"echo '{json.dumps(faults)}' > {path}" if faults else f"rm -f {path}",
        check=True)


@pytest.fixture(scope="module")
def serving(lab):
    """h200-pd-1node serving on lab1 (after the modules before this one: a re-run)."""
    proc = fab("deploy", *TARGET)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]


@pytest.fixture(autouse=True)
def no_faults_after():
    yield
    inject(None)
    # a GPU fault makes the health watcher drain the host (engines stopped); healthy
    # again, it starts them: the next test finds the host serving
    deadline = time.monotonic() + 120
    while ssh("lab1", f"systemctl is-active {ENGINES}").split() != ["active"] * 2:
        assert time.monotonic() < deadline, "the engines did not come back after the faults"
        time.sleep(2)


def test_serving_gpus_are_refused_then_measured_with_the_faults_named(serving):
    proc = fab("acceptance", *TARGET)
    assert proc.returncode == 1
    assert "the engines serve on these GPUs" in proc.stdout and "--while-serving" in proc.stdout

    inject({"nvlink_inactive": {"5": list(range(10))}, "memory_errors": {"2": 3}})
    proc = fab("acceptance", *TARGET, "--while-serving", "--format", "json")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    report = json.loads(proc.stdout)["hosts"]["lab1"]
    checks = report["checks"]
    by = {}
    for c in checks:
        by.setdefault((c["kind"], c["name"]), []).append(c)
    assert sorted(k for k in by if k[0] == "nccl") == [("nccl", "decode"), ("nccl", "prefill")]
    assert all(c["verdict"] == "pass" and c["gpus"] == [0, 1, 2, 3] for c in by["nccl", "prefill"])
    for c in by["nccl", "decode"]:  # GPU 5 has 8 of its 18 links: the group runs at 44%
        assert c["verdict"] == "FAIL" and c["gpus"] == [4, 5, 6, 7]
        assert "GPU 5: NVLink links 0,1,2,3,4,5,6,7,8,9 inactive" in c["detail"]
    bad = [c for c in checks if c["kind"] == "gpu" and c["verdict"] == "FAIL"]
    assert [(c["name"], c["metric"]) for c in bad] == [("GPU 2", "mem_write_gbs")]
    assert sum(c["kind"] == "gpu" for c in checks) == 16  # 8 GPUs x (memory, matmul)

    text = fab("acceptance", *TARGET, "--while-serving")
    assert text.returncode == 1
    assert "FAIL lab1: nccl decode: bus bandwidth 44% of expected" in text.stdout
    assert "FAIL lab1: gpu GPU 2: 12 words read back wrong" in text.stdout


def test_a_hung_collective_is_named_within_the_timeout(serving):
    inject({"nccl_hang": True})
    proc = fab("acceptance", *TARGET, "--while-serving", "--timeout", "5", "--gpus", "4,5,6,7")
    assert proc.returncode == 1
    assert ("hung collective: the all_reduce decode across GPUs 4,5,6,7 did not finish in 5 s"
            in proc.stdout)
    assert "nccl prefill" not in proc.stdout  # --gpus: the decode GPUs alone
    # [a]: the pattern does not match the shell that runs pgrep
    assert ssh("lab1", "pgrep -f '[a]cceptance.py nccl-rank' || echo none").strip() == "none"


def test_the_deploy_gate_stops_before_the_checkpoint_and_passes_once_healthy(serving):
    # the gate sits between prepare and the checkpoint in site.yml
    plays = playbook("site.yml", "--list-tasks", "-e", "gpufleet_target=h200-pd-1node")
    order = re.findall(r"^\s*play #\d+ \(gpufleet_planned\): (\w+)", plays.stdout, re.M)
    # each stage that can lose a host before anything serves is followed by the play that
    # quarantines its failed hosts (playbooks/quarantine.yml)
    for stage in ("Prepare", "Acceptance", "Cache"):
        assert order[order.index(stage) + 1] == "Quarantine", order
    stages = [play for play in order if play != "Quarantine"]
    assert stages.index("Acceptance") == stages.index("Prepare") + 1, order
    assert stages.index("Cache") == stages.index("Acceptance") + 1, order

    gate = ("playbooks/acceptance.yml", "-e", "gpufleet_target=h200-pd-1node",
            "-e", "acceptance_gate=true", "-e", "gpufleet_acceptance_gate=true")
    proc = playbook(*gate)  # the engines serve: the gate leaves the host alone
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "TASK [Acceptance | Measure" not in proc.stdout
    assert recap(proc.stdout)["lab1"]["failed"] == 0

    ssh("lab1", f"systemctl stop {ENGINES}", check=True)  # a host not yet serving
    try:
        inject({"nvlink_inactive": {"1": list(range(12))}})
        proc = playbook(*gate)
        assert proc.returncode == 2, proc.stdout[-3000:]
        said = " ".join(proc.stdout.split())
        assert "lab1 failed acceptance" in said and "GPU 1: NVLink links 0,1" in said
        assert "The deploy stops before the checkpoint and the engines" in said

        inject(None)
        proc = playbook(*gate)
        assert proc.returncode == 0, proc.stdout[-3000:]
        assert recap(proc.stdout)["lab1"]["failed"] == 0
    finally:
        ssh("lab1", f"systemctl start {ENGINES}", check=True)
