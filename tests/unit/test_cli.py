"""The operator interfaces other tools rely on: `fab targets`, `fab plan` (text and
the JSON shape in docs/architecture.md), exit codes, and inventories read by Ansible."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
# the fab program of this checkout (its console scripts need not be installed: the
# controller Pythons' test venvs hold only the dependencies)
FAB = [sys.executable, "-m", "gpufleet"]
REQUIRED_TARGETS = {
    "gb200-tray", "h200-pd-1node", "b200-pd-1node", "h200-agg", "h200-disagg",
    "gb200-agg", "gb200-disagg", "sglang-h200-low-latency", "sglang-b300-balanced-bf16",
    "sglang-gb300-high-throughput-nvfp4", "sglang-mi355x-pd", "sglang-h200-low-latency-bf16",
}


def fab(*args, check=True):
    proc = subprocess.run([*FAB, *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "NO_COLOR": "1"}, check=False)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_fab_finds_the_tasks_from_the_repository_root():
    out = fab("--list").stdout
    for name in ("targets", "plan", "deploy"):
        assert name in out


def test_targets_json_lists_every_required_target():
    rows = json.loads(fab("targets", "--format", "json").stdout)
    names = {r["name"] for r in rows}
    assert names >= REQUIRED_TARGETS
    assert all(r["summary"] for r in rows)
    # 004's rules for the matrix: NVFP4 only on Blackwell, BF16 where it fits
    assert not {n for n in names if n.endswith("-nvfp4") and ("h200" in n or "mi3" in n)}
    assert "sglang-mi300x-low-latency-bf16" not in names


@pytest.mark.parametrize("target", ["h200-pd-1node", "gb200-disagg", "sglang-h200-pd"])
def test_plan_json_has_the_documented_shape(target):
    plan = json.loads(fab("plan", "--target", target, "--format", "json").stdout)
    assert {"target", "engine", "model", "processes", "hosts", "warnings"} <= set(plan)
    assert {"repo", "revision", "served_name"} <= set(plan["model"])
    for p in plan["processes"]:
        assert {"name", "role", "host", "argv", "env", "unit", "ports", "gpus"} <= set(p)
        assert p["argv"][0].startswith("/")
        assert p["unit"].endswith(".service")
        assert p["host"] in plan["hosts"]


def test_plan_text_shows_commands_and_env():
    out = fab("plan", "--target", "h200-pd-1node").stdout
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT=5557" in out
    assert "vllm-router --policy round_robin --vllm-pd-disaggregation" in out


def test_bad_input_exits_2_with_the_fix():
    proc = fab("plan", "--target", "h200-pd-1nod", check=False)
    assert proc.returncode == 2
    assert "did you mean h200-pd-1node" in proc.stderr
    assert "nothing was changed" in proc.stderr


@pytest.mark.parametrize("args,said", [
    (["targets", "--format", "yaml"], "--format 'yaml' is not one of text, json"),
    (["plan", "--target", "h200-agg", "--format", "jsno"], "--format 'jsno' is not one of"),
    (["endpoint", "--format", "xml"], "--format 'xml' is not one of text, json, env"),
    (["status", "--format", "yaml"], "--format 'yaml' is not one of text, json"),
    (["health", "--format", "yaml"], "--format 'yaml' is not one of text, json"),
    (["acceptance", "--threshold", "abc"], "--threshold 'abc': give a number"),
    (["acceptance", "--threshold", "1.5"], "--threshold 1.5: give a share in (0, 1]"),
    (["acceptance", "--timeout", "soon"], "--timeout 'soon': give an integer from 1"),
    (["bench", "--concurrency", "x"], "--concurrency 'x': give an integer from 1"),
    (["bench", "--output-len", "0"], "--output-len '0': give an integer from 1"),
    (["logs", "-n", "many"], "-n 'many': give an integer from 1"),
])
def test_a_bad_option_value_exits_2_naming_it_without_a_traceback(args, said):
    proc = fab(*args, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert said in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_a_closed_pipe_ends_the_listing_quietly():
    """`fab targets | head -1`: no BrokenPipeError."""
    proc = subprocess.run(f"{shlex.join(FAB)} targets | head -1", shell=True, cwd=ROOT, text=True,
                          capture_output=True, check=False)
    assert proc.stdout.startswith("target ") and proc.stderr == "", proc.stderr


# (--api-key, also one: refused earlier as a credential, test_bad_overrides.py)
@pytest.mark.parametrize("override", ["--port=8000", "--host=0.0.0.0",
                                      "--uvicorn-log-level=info", "--tool-call-parser=glm47"])
def test_dynamo_workers_refuse_the_vllm_server_flags(override):
    """Dynamo 1.6.1's `dynamo.vllm` parses vLLM's engine arguments, not its OpenAI
    server's: the real parser refuses these, so the plan does."""
    proc = fab("plan", "--target", "h200-agg", "--set", f"worker:{override}", check=False)
    flag = override.split("=")[0]
    assert proc.returncode == 2 and f"unknown flag {flag}" in proc.stderr, proc.stderr


def test_set_overrides_are_refused_when_they_break_a_rule():
    proc = fab("plan", "--target", "h200-pd-1node", "--set",
               "decode:VLLM_KV_CACHE_LAYOUT=NHD", check=False)
    assert proc.returncode == 2 and "VLLM_KV_CACHE_LAYOUT" in proc.stderr
    proc = fab("plan", "--target", "h200-pd-1node", "--set", "decode-max-num-seqs", check=False)
    assert proc.returncode == 2 and "ROLE:KEY=VALUE" in proc.stderr


@pytest.mark.parametrize("name,target,hosts", [
    ("h200", "h200-disagg", {"h200-node1", "h200-node2"}),
    ("gb200", "gb200-disagg", {"gb200-tray1", "gb200-tray2"}),
    ("b200", "b200-pd-1node", {"b200-node1"}),
    ("sample", "h200-pd-1node", {"gpu-node1"}),
])
def test_sample_inventories_plan_their_target(name, target, hosts):
    plan = json.loads(fab("plan", "-i", f"inventories/{name}", "--format", "json").stdout)
    assert plan["target"] == target
    assert set(plan["hosts"]) == hosts


def test_the_amd_sample_inventory_runs_from_the_rocm_image_and_venv_is_refused():
    """PyPI's SGLang wheels are CUDA builds: AMD hosts default to the image runtime, and
    asking for the venv runtime there is refused with why and what instead."""
    plan = json.loads(fab("plan", "-i", "inventories/mi355x", "--format", "json").stdout)
    engine = plan["hosts"]["mi355x-node1"]["engine"]
    assert (engine["runtime"], engine["image"], engine["lock"]) == (
        "image", "docker.io/lmsysorg/sglang:v0.5.23-rocm720-mi35x", None)
    proc = fab("plan", "-i", "inventories/mi355x", "--runtime", "venv", check=False)
    assert proc.returncode == 2, proc.stdout
    assert "nothing was changed" in proc.stderr
    assert ("no ROCm build of sglang 0.5.23 is on the package index (https://pypi.org/simple); "
            "the venv runtime would install CUDA wheels on an AMD host (AMD Instinct MI355X: "
            "mi355x-node1)") in proc.stderr
    assert "Fix: run it from the recipe's ROCm container image" in proc.stderr


def test_gb200_inventory_gets_an_imex_domain_of_both_trays():
    plan = json.loads(fab("plan", "-i", "inventories/gb200", "--format", "json").stdout)
    for host in plan["hosts"].values():
        assert host["imex"] == {"domain": ["192.0.2.21", "192.0.2.22"]}


def test_ansible_playbook_refuses_a_mismatched_inventory_before_any_host():
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg")}
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("ansible-playbook")), "-i", "inventories/h200",
         "site.yml", "-e", "gpufleet_target=h200-pd-1node"],
        cwd=ROOT, capture_output=True, text=True, env=env, check=False)
    assert proc.returncode != 0
    assert "needs exactly 1 host(s) in group 'workers'" in proc.stdout
    assert "h200-node1" not in proc.stdout.split("PLAY RECAP")[-1]



@pytest.mark.parametrize("target,reason,instead", [
    ("sglang-h200-balanced-nvfp4", "NVFP4, which runs only on Blackwell, not on NVIDIA H200",
     ["sglang-h200-balanced (FP8", "sglang-b200-balanced-nvfp4"]),
    ("sglang-mi300x-balanced-bf16", "needs 1406 GiB of weights but the worker engine has 8 x "
     "192.0 GiB x 0.80 = 1229 GiB on 1 AMD Instinct MI300X node",
     ["sglang-mi300x-balanced (FP8", "sglang-mi325x-balanced-bf16"]),
    ("sglang-mi355x-low-latency-nvfp4", "runs only on Blackwell, not on AMD Instinct MI355X",
     ["sglang-mi355x-low-latency (FP8", "sglang-gb300-low-latency-nvfp4"]),
])
def test_a_combination_004_excludes_exits_2_with_why_and_what_instead(target, reason, instead):
    proc = fab("plan", "--target", target, check=False)
    assert proc.returncode == 2, proc.stderr
    assert f"{target} is not offered" in proc.stderr and reason in proc.stderr
    assert "unknown target" not in proc.stderr
    fix = proc.stderr.split("Fix: ", 1)[1]
    assert all(name in fix for name in instead), proc.stderr


def test_targets_does_not_list_the_excluded_combinations():
    names = {r["name"] for r in json.loads(fab("targets", "--format", "json").stdout)}
    text = fab("targets").stdout
    for name in ("sglang-h200-balanced-nvfp4", "sglang-mi300x-balanced-bf16",
                 "sglang-mi325x-high-throughput-nvfp4"):
        assert name not in names and name not in text


def test_an_unknown_name_still_gets_the_nearest_names():
    proc = fab("plan", "--target", "sglang-h200-balanced-nvfp", check=False)
    assert proc.returncode == 2
    assert "unknown target 'sglang-h200-balanced-nvfp'" in proc.stderr
    assert "did you mean" in proc.stderr and "sglang-b200-balanced-nvfp4" in proc.stderr



def test_fab_health_text_shows_the_whole_failure_and_the_sick_host():
    import io

    from gpufleet.cli import health_text

    detail = ("Xid 79 on GPU 1 (GPU-fda287b8-4d96-ad0b-7f3d-0efabb9894f4, 00000000:00:07.0) "
              "(1x since 2026-12-01 13:00:00). Action: the GPU fell off the bus: reboot the host")
    results = {"lab1": {"healthy": False, "host_fault": ["gpu_xid"], "checks": [
        {"check": "gpu_xid", "unit": "", "status": "fail", "detail": detail},
        {"check": "cache", "unit": "", "status": "ok", "detail": "/cache: 90 GiB free"}]},
        "lab2": {"healthy": True, "host_fault": [], "checks": [
            {"check": "gpu", "unit": "", "status": "ok", "detail": "8 GPUs"}]}}
    out = io.StringIO()
    health_text(results, ["lab3"], out)
    text = out.getvalue()
    assert f"lab1 gpu_xid -: {detail}\n" in text  # the action is never cut off
    assert "lab1: SICK (gpu_xid): its engines' restarts are held; fix what" in text
    assert "lab2: SICK" not in text and "lab3: unreachable" in text
    assert max(len(line) for line in text.splitlines() if line.startswith("lab2")) < 100


def test_fab_status_names_a_sick_host_with_its_checks_and_since():
    from gpufleet.cli import sick_text

    line = sick_text("lab1", {"checks": ["gpu_fabric", "gpu_xid"], "since": 1796140000})
    assert line.startswith("lab1: SICK since 20")
    assert "(gpu_fabric, gpu_xid): its engines' restarts are held; fix what" in line
    line = sick_text("lab1", {"checks": ["gpu_xid"], "since": 1796140000,
                              "drained": ["gpufleet-decode.service"]})
    assert ("(gpu_xid): engines stopped, out of their routers' pools "
            "(gpufleet-decode.service) until its checks pass") in line
