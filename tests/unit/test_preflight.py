"""Host facts against the plan's host requirements (gpufleet/module_utils/preflight.py).

Facts come from the lab's simulated tools parsed by the real parser (the same
path the roles take), and from the capture of a real H200."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_hwsim import host  # noqa: F401  (the simulated-host fixture)

from gpufleet import rules
from gpufleet.module_utils import gpu_facts as gf
from gpufleet.module_utils.preflight import check_host, check_prepared
from gpufleet.plan import make_plan

DEVICE = Path(__file__).parents[1] / "fixtures" / "hardware" / "h200-1gpu-preflight"


def req(target: str, role: str = "prefill") -> dict:
    plan = make_plan(target)
    (proc,) = plan.by_role(role)
    return plan.to_json()["hosts"][proc.host]


def problems_for(host, target, profile, *faults, role="prefill", free=10_000.0):  # noqa: F811
    h = host(profile, *faults)
    cpu_arch = json.loads(h.read("/etc/gpufleet-lab/hw.json"))["cpu_arch"]  # as `uname -m` says
    return check_host(req(target, role), h.gpu_facts(), h.ib_facts(), cpu_arch, free)


@pytest.mark.parametrize("target,profile,role", [
    ("h200-pd-1node", "h200x8", "prefill"),
    ("h200-disagg", "h200x8", "decode"),
    ("sglang-mi355x-low-latency", "mi355x8", "worker"),
    ("sglang-mi300x-balanced", "mi300x8", "worker"),
    ("sglang-mi300x-pd", "mi300x8", "decode"),
    ("sglang-mi325x-balanced", "mi325x8", "worker"),
    ("sglang-b300-balanced", "b300x8", "worker"),
    ("sglang-b300-pd", "b300x8", "prefill"),
    ("sglang-gb300-balanced", "gb300x4", "worker"),
    ("sglang-gb300-pd", "gb300x4", "decode"),
])
def test_matching_host_passes(host, target, profile, role, monkeypatch):  # noqa: F811
    # an AMD target's plan is refused (no ROCm engine build: test_rules); its host
    # requirements are still what preflight checks an AMD host against
    monkeypatch.setattr(rules, "RULES",
                        [r for r in rules.RULES if r is not rules.venv_runtime_needs_nvidia])
    assert problems_for(host, target, profile, role=role) == []


@pytest.mark.parametrize("fault,text", [
    ("gpu-missing", "7 GPU(s) visible"),
    ("driver-old", "older than 580.65.06"),
])
def test_gpu_faults_are_named_with_the_fix(host, fault, text):  # noqa: F811
    found = problems_for(host, "h200-pd-1node", "h200x8", fault)
    assert any(text in p and "Fix:" in p for p in found), found


def test_after_preparation_fm_mismatch_and_peermem_are_named(host):  # noqa: F811
    h = host("h200x8", "fm-mismatch")
    found = check_prepared(req("h200-disagg", "decode"), h.gpu_facts(), h.ib_facts())
    assert any("does not match driver 580.159.04" in p and
               "apt-mark hold nvidia-fabricmanager-580" in p for p in found), found
    assert any("nvidia_peermem is not loaded" in p for p in found)
    ok = host("h200x8")
    assert check_prepared(req("h200-pd-1node"), ok.gpu_facts(), ok.ib_facts()) == []


@pytest.mark.parametrize("fault,text", [
    ("no-ib", "no InfiniBand/RoCE HCA"),
    ("ib-down", "not Active"),
])
def test_rdma_faults_fail_only_where_the_target_needs_rdma(host, fault, text):  # noqa: F811
    assert any(text in p for p in problems_for(host, "h200-disagg", "h200x8", fault,
                                               role="decode"))
    assert problems_for(host, "h200-pd-1node", "h200x8", fault) == []


def test_wrong_hardware_and_small_cache(host):  # noqa: F811
    found = problems_for(host, "h200-pd-1node", "mi355x8", free=100.0)
    assert any("GPUs are AMD Instinct MI355X" in p for p in found)
    assert any("100.0 GiB free" in p and "336.6 GiB" in p for p in found)


def test_cpu_architecture_mismatch():
    facts = {"present": True, "count": 4, "model": "NVIDIA GB200", "memory_mib": 189471,
             "driver_version": "580.159.04"}
    found = check_host(req("gb200-tray", "worker"), facts, {}, "x86_64", None)
    assert any("needs aarch64 hosts" in p for p in found)


def test_real_h200_capture_against_an_8_gpu_target():
    """The real single-GPU H200 host fits nothing that needs 8 GPUs, and says why."""
    xml = (DEVICE / "nvidia-smi-q.xml").read_text()
    facts = gf.gpu_facts(xml=xml)
    found = check_host(req("h200-agg", "worker"), facts, {}, "x86_64", None)
    assert found == [
        "1 GPU(s) visible, the plan uses GPU indices up to 7 (8 GPUs). Fix: check "
        "`nvidia-smi -L` for a missing GPU (reseat, XID errors) or use a smaller target"
    ]
    assert json.loads(json.dumps(facts))["driver_version"] == "580.159.04"


def test_recorded_run_on_the_real_h200_matches_what_the_code_says_now():
    """scripts/real-host/preflight_script.py ran on a real 1-GPU H200 (report committed); the
    same facts through today's check give the same verdicts."""
    report = json.loads((DEVICE / "preflight-report.json").read_text())
    assert report["facts"]["count"] == 1 and report["facts"]["model"] == "NVIDIA H200"
    for name, result in report["results"].items():
        target, role = name.split("/")
        now = check_host(req(target, role), report["facts"], report["ib"],
                         report["cpu_arch"], report["free_gib"])
        assert now == result["preflight"], name
    assert any("needs aarch64" in p for p in report["results"]["gb200-tray/worker"]["preflight"])


# ---------------------------------------------------------------- ports and cache path

def test_a_port_held_by_another_program_is_named_with_its_pid():
    import os
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    port = sock.getsockname()[1]
    try:
        from gpufleet.module_utils.preflight import _ports_taken, listeners
        listening = listeners()
        assert any(pid == os.getpid() for pid, _, _ in listening[port])
        (problem,) = _ports_taken({"ports": [port]}, listening)
        assert f"port {port} is already in use by" in problem and f"pid {os.getpid()}" in problem
        assert "Fix: stop it" in problem
    finally:
        sock.close()
    assert _ports_taken({"ports": [port]}, listeners()) == []


def test_a_port_held_by_our_own_unit_is_a_rerun_not_a_problem():
    from gpufleet.module_utils.preflight import _ports_taken
    ours = {8000: [(42, "nginx", "gpufleet-gateway.service")]}
    theirs = {8000: [(43, "nginx", "nginx.service")]}
    assert _ports_taken({"ports": [8000]}, ours) == []
    assert "nginx (pid 43, nginx.service)" in _ports_taken({"ports": [8000]}, theirs)[0]


def test_a_read_only_cache_path_is_refused(tmp_path):
    import subprocess

    from gpufleet.module_utils.preflight import _cache_writable
    ro = tmp_path / "ro"
    ro.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], check=True)
    try:
        (problem,) = _cache_writable({"cache": {"path": f"{ro}/hf"}}, str(ro))
    finally:
        subprocess.run(["umount", str(ro)], check=True)
    assert f"cache path {ro}/hf is on a read-only filesystem" in problem
    assert "Fix: mount the shared cache read-write" in problem
    assert _cache_writable({"cache": {"path": str(tmp_path / "hf")}}, str(tmp_path)) == []


def test_a_stray_beside_our_own_unit_is_named_alone():
    """The worker on loopback and a stray on the host's address share the port number:
    the refusal names the stray, not the deployment's own unit."""
    from gpufleet.module_utils.preflight import _ports_taken
    both = {30000: [(41, "python3", "gpufleet-worker.service"),
                    (44, "python3", "lab-stray.service")]}
    (problem,) = _ports_taken({"ports": [30000]}, both)
    assert "python3 (pid 44, lab-stray.service)" in problem and "gpufleet-worker" not in problem
