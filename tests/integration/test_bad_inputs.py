"""Bad inputs are refused with the problem and the fix, and no host changes.

The lab first runs a real deployment (so there is something to damage). Each case then
runs `fab deploy` with one bad input; the test asserts the exit code, that the message
names the problem and the fix, and that every host's files are exactly as before
(a digest of path, size, mtime, mode and owner of everything gpufleet writes, plus
the content of /etc). Exit 2 = refused by the planner on the controller; exit 1 =
refused by preflight (controller or hosts), still before any change.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from labutil import digests, fab, lab_inventory, ssh

pytestmark = pytest.mark.lab

@dataclass
class Case:
    args: list[str]
    words: list[str]                 # the problem and the fix, as the operator reads them
    rc: int = 2
    all_vars: dict = field(default_factory=dict)    # added to the inventory's group_vars
    host_vars: dict = field(default_factory=dict)   # host -> vars merged into that host
    groups: dict | None = None                      # replaces the group membership
    env: dict = field(default_factory=dict)
    squat: int | None = None   # a foreign program listens on this port of lab1 meanwhile


VLLM_PD = ["--target", "h200-pd-1node"]
CASES = {
    "unknown-target": Case(["--target", "h200-pd-1nod"],
                           ["unknown target 'h200-pd-1nod'", "did you mean h200-pd-1node"]),
    "no-target": Case([], ["no target given", "Fix: pass --target NAME or set gpufleet_target"],
                      all_vars={"gpufleet_target": None}),
    "unknown-option": Case([*VLLM_PD, "--with", "hicash"],
                           ["unknown option 'hicash'", "Fix: choose from"]),
    "option-for-another-engine": Case([*VLLM_PD, "--with", "hicache"],
                                      ["applies to sglang", "Fix: drop --with hicache"]),
    "set-without-role": Case([*VLLM_PD, "--set", "decode--max-num-seqs=256"],
                             ["is not ROLE:KEY=VALUE", "Fix: write e.g."]),
    "set-unknown-role": Case([*VLLM_PD, "--set", "brain:--max-num-seqs=256"],
                             ["runs no 'brain' process", "Fix: name one of its roles"]),
    "misspelt-flag": Case([*VLLM_PD, "--set", "decode:--max-num-seq=256"],
                          ["unknown flag --max-num-seq", "Fix: remove or correct the flag"]),
    "value-not-a-choice": Case([*VLLM_PD, "--set", "router:--policy=fastest"],
                               ["'fastest' is not one of", "Fix:"]),
    "speculative-differs": Case(
        [*VLLM_PD, "--set",
         'decode:--speculative-config={"method":"mtp","num_speculative_tokens":3}'],
        ["different speculative decoding settings", "Fix:"]),
    "kv-layout-differs": Case([*VLLM_PD, "--set", "decode:VLLM_KV_CACHE_LAYOUT=NHD"],
                              ["VLLM_KV_CACHE_LAYOUT", "Fix:"]),
    "fp8-kv-on-hopper": Case([*VLLM_PD, "--set", "engines:--kv-cache-dtype=fp8"],
                             ["Hopper", "Fix:"]),
    "tp-larger-than-gpus": Case([*VLLM_PD, "--set", "engines:--tensor-parallel-size=8"],
                                ["TP 8", "is given 4", "Fix: make tensor x pipeline"]),
    "weights-do-not-fit": Case([*VLLM_PD, "--set", "engines:--gpu-memory-utilization=0.05"],
                               ["GiB of weights", "Fix: use the FP8 checkpoint"]),
    "hosts-declared-other-hardware": Case(
        ["--target", "sglang-mi355x-low-latency"],
        ["declared 'h200'", "Fix: pick a h200 target"]),
    "too-few-hosts-in-group": Case(
        ["--target", "sglang-h200-low-latency-bf16"],
        ["needs exactly 2 host(s) in group 'workers'", "Fix: put 2 host(s) in [workers]"]),
    "missing-inventory": Case([*VLLM_PD, "-i", "/nonexistent/inventory"],
                              ["'/nonexistent/inventory' does not exist", "Fix: pass -i"]),
    "port-as-text": Case(VLLM_PD, ["gpufleet_ports.router.http: 'eighty' is not a port "
                                   "number from 1024 to 65535", "Fix: choose a free port"],
                         all_vars={"gpufleet_ports": {"router": {"http": "eighty"}}}),
    "api-key-not-a-bool": Case(VLLM_PD, ["overrides.api_key", "Fix: see"],
                               all_vars={"gpufleet_api_key": "perhaps"}),
    "gpus-overlap": Case(VLLM_PD, ["already used by prefill", "Fix:"],
                         all_vars={"gpufleet_gpus": {"decode": [3, 4, 5, 6]}}),
    "ports-clash": Case(VLLM_PD, ["port 8001 on lab1 is also used", "Fix: set ports.router"],
                        all_vars={"gpufleet_ports": {"router": {"http": 8001}}}),
    "gateway-on-loopback": Case(
        VLLM_PD, ["API gateway would listen on 127.0.0.1:8000", "Fix: give lab1 its internal"],
        host_vars={"lab1": {"gpufleet_internal_address": "127.0.0.1"}}),
    # --- refused by preflight: on the controller or read from the hosts
    "revision-does-not-exist": Case(
        VLLM_PD, ["v0.0-nope", "Fix: check gpufleet_model_revision"], rc=1,
        all_vars={"gpufleet_model_revision": "v0.0-nope"}),
    "token-refused": Case(
        VLLM_PD, ["refused the token", "Fix: set HF_TOKEN on the controller or gpufleet_hf_token"],
        rc=1,
        env={"HF_TOKEN": "not-a-real-token-the-mirror-refuses"}),
    "port-in-use": Case(
        VLLM_PD, ["port 8003 is already in use by python3", "squatter-8003.service",
                  "Fix: stop it"], rc=1,
        all_vars={"gpufleet_ports": {"decode": {"http": 8003}}}, squat=8003),
    "cache-on-read-only-fs": Case(
        VLLM_PD, ["cache path /sys/fs/gpufleet-cache is on a read-only filesystem",
                  "Fix: mount the shared cache read-write"], rc=1,
        all_vars={"gpufleet_cache_dir": "/sys/fs/gpufleet-cache"}),
    "cache-filesystem-too-small": Case(
        VLLM_PD, ["GiB free, the checkpoint needs", "Fix: free space or point gpufleet_cache_dir"],
        rc=1, all_vars={"gpufleet_cache_dir": "/run/gpufleet-cache"}),
    "hosts-have-other-gpus": Case(
        ["--target", "b200-pd-1node"], ["the target needs", "B200", "Fix: pick the target"],
        rc=1, host_vars={"lab1": {"gpufleet_hardware": None}}),
    "hosts-have-other-cpus": Case(
        ["--target", "gb200-tray"], ["CPU is x86_64 but the target needs aarch64", "Fix:"],
        rc=1, host_vars={"lab1": {"gpufleet_hardware": None}}),
    "host-unreachable": Case(
        ["--target", "h200-disagg"], ["lab9", "UNREACHABLE", "Fix: check that the host is up"],
        rc=1, host_vars={"lab9": {"ansible_host": "10.213.77.99", "gpufleet_hardware": "h200"}},
        groups={"workers": ["lab1"], "prefill": ["lab1"], "decode": ["lab9"]}),
}


@pytest.fixture(scope="module")
def deployed(lab):
    proc = fab("deploy", "--target", "h200-pd-1node")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    return lab


def test_there_are_at_least_25_cases():
    assert len(CASES) >= 25


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_refused_and_no_host_changes(deployed, tmp_path, name):
    case = CASES[name]
    args = list(case.args)
    if "-i" not in args and (case.all_vars or case.host_vars or case.groups is not None):
        args += ["-i", lab_inventory(tmp_path, case.all_vars, case.host_vars, case.groups)]
    if case.squat:
        ssh("lab1", f"systemd-run --unit squatter-{case.squat} "
                    f"python3 -m http.server {case.squat}", check=True)
        ssh("lab1", f"for i in $(seq 50); do ss -ltn | grep -q :{case.squat} && break; "
                    "sleep 0.1; done")
    try:
        before = digests()
        proc = fab("deploy", *args, env=case.env)
        # Ansible's YAML output wraps long messages: compare with whitespace folded
        text = " ".join((proc.stdout + proc.stderr).split())
    finally:
        if case.squat:
            ssh("lab1", f"systemctl stop squatter-{case.squat}")
    assert proc.returncode == case.rc, text[-3000:]
    for words in case.words:
        assert words in text, f"{words!r} not in:\n{text[-3000:]}"
    assert digests() == before, "a host changed"
