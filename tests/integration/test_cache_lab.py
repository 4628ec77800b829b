"""The cache role on the lab: a refused token is named, and never printed anywhere:
not in Ansible's -vvv output, not in a host's journal, not in a file on the hosts; two
fetch hosts share one download, each byte from the mirror once, with progress shown (through
ansible-runner, as AWX runs it, with the execution environment's settings)."""

from __future__ import annotations

import json
import os
import re
import urllib.request
import uuid

import ansible_runner
import pytest
import yaml
from labutil import BIN, ROOT, playbook, ssh

from gpufleet_lab import services

pytestmark = pytest.mark.lab


def test_a_bad_token_is_refused_clearly_and_never_printed(lab):
    secret = f"gpufleet-test-token-{uuid.uuid4().hex}"
    proc = playbook("-vvv", "-i", "inventories/lab", "playbooks/preflight.yml",
                    "playbooks/cache.yml", "-e", "gpufleet_target=h200-pd-1node",
                    "-e", "gpufleet_cache_dir=/var/cache/gpufleet/hf/token-test",
                    "-e", f"gpufleet_hf_token={secret}")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "gpufleet_hf_token in ansible-vault" in " ".join(out.split())
    assert secret not in out
    for host in ("lab1", "lab2"):
        assert secret not in ssh(host, "journalctl --no-pager -o cat")
        # /root: Ansible's async job records (~/.ansible_async) hold a job's invocation
        assert ssh(host, f"grep -rl {secret} /etc /var/lib/gpufleet /var/cache/gpufleet "
                         "/opt/gpufleet /tmp /root 2>/dev/null; true").strip() == ""


def _mirror(path: str, method: str = "GET") -> dict:
    req = urllib.request.Request(f"{services.hf_mirror_url()}/_admin/{path}", method=method)
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


# slow (about a minute): the shares and the progress are tested in tests/unit
# (test_cache_fetch.py, test_progress_callback.py); this is them end to end on two hosts
@pytest.mark.slow
def runner_env() -> dict[str, str]:
    """What the execution environment sets for ansible-runner (its ENV lines), with the
    project at ROOT instead of AWX's /runner/project."""
    steps = yaml.safe_load((ROOT / "execution-environment.yml").read_text())[
        "additional_build_steps"]["append_final"]
    env = dict(s[len("ENV "):].split("=", 1) for s in steps if s.startswith("ENV "))
    return {k: v.replace("/runner/project", str(ROOT)) for k, v in env.items()}


def test_two_fetch_hosts_take_a_share_each_with_progress_and_every_byte_once(lab, tmp_path):
    # each host's link to the mirror held to 0.25 MiB/s, so the fetch lasts long enough
    # for the progress polls to see it move (the lab checkpoint is 2 MiB)
    cache = f"/var/cache/gpufleet/hf/shares-{uuid.uuid4().hex[:8]}"
    # lab2 without apt's package lists, as a fresh image leaves a host: the fetch host the
    # play delegates to must refresh them by its own state, not the play host's
    ssh("lab2", "find /var/lib/apt/lists -maxdepth 1 -type f -delete", check=True)
    _mirror("rate?mib=0.25&per=client", "POST")
    _mirror("reset", "POST")
    try:
        # a target of two hosts (h200-pd-1node has one: cache_fetch_hosts=2 is refused there),
        # through ansible-runner as AWX runs it, in the execution environment's environment
        run = ansible_runner.run(
            private_data_dir=str(tmp_path), project_dir=str(ROOT), playbook="site.yml",
            cmdline="--tags cache", inventory=str(ROOT / "inventories" / "lab"), quiet=True,
            extravars={"gpufleet_target": "sglang-h200-pd", "gpufleet_cache_dir": cache,
                       "cache_fetch_hosts": 2},
            envvars={"PATH": f"{BIN}:{os.environ['PATH']}", **runner_env()})
        stats = _mirror("stats")
    finally:
        _mirror("rate?mib=0", "POST")
    out = run.stdout.read()
    assert (run.status, run.rc) == ("successful", 0), out[-3000:]
    # off a terminal the callback prints plain progress lines: bytes, rate, ETA, files
    size = r"[\d.]+ (?:B|[KMG]iB)"
    shown = re.findall(rf"^progress: (lab[12]): (zai-org/[\w.-]+): +[\d.]+% {size} of {size}, "
                       rf"{size}/s, .* left, \d+/\d+ files$", out, re.M)
    assert {host for host, _ in shown} == {"lab1", "lab2"}, out[-3000:]
    repo = shown[0][1]
    assert "FAILED - RETRYING" not in out
    # every byte of the checkpoint came from the mirror once, split between the two hosts
    files = {k: v for k, v in stats["files"].items() if k.startswith(f"{repo}/")}
    assert files and all(v["complete"] == 1 for v in files.values())
    logs = {h: ssh(h, "cat /var/log/gpufleet/cache-fetch.log") for h in ("lab1", "lab2")}
    assert "share 1 of 2" in logs["lab1"] and "share 2 of 2" in logs["lab2"]
    # lab1 completed the manifest; both hosts see the files (the role's verify step)
    assert "snapshots" in ssh("lab2", f"ls {cache}/hub/models--{repo.replace('/', '--')}")
    ssh("lab1", f"rm -rf {cache}", check=True)
