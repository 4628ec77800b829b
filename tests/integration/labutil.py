"""What the lab tests share: running fab and ansible-playbook, ssh into lab hosts, the
deployment's endpoint as a client reaches it (HTTPS verified with its CA), and reading
Ansible's PLAY RECAP."""

from __future__ import annotations

import difflib
import json
import os
import re
import shutil
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import yaml

from gpufleet_lab import hosts as lab_hosts

ROOT = Path(__file__).parents[2]
BIN = Path(sys.executable).parent
# the venv's programs first: molecule and ansible-lint call ansible-config and the like by
# name, so a run of .venv/bin/pytest without the venv activated finds them too
ENV = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "NO_COLOR": "1",
       "ANSIBLE_FORCE_COLOR": "0", "PATH": f"{BIN}:{os.environ.get('PATH', '')}"}


def fab(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "fab"), *args], cwd=ROOT, capture_output=True, text=True,
                          env={**ENV, **(env or {})}, timeout=900, check=False)


def endpoint(*args: str) -> dict:
    """`fab endpoint --format json` (ARGS: -i, --target): endpoint, api_key, ca_file, ..."""
    proc = fab("endpoint", *args, "--format", "json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


def tls(info: dict) -> ssl.SSLContext | None:
    """How a client verifies the endpoint of INFO (fab endpoint's JSON): with its CA."""
    if not info["endpoint"].startswith("https:"):
        return None
    return ssl.create_default_context(cafile=info.get("ca_file"))


def api_client(info: dict, key: str | None = None, timeout: float = 30) -> openai.OpenAI:
    """The real OpenAI client for the endpoint of INFO, its key unless KEY is given."""
    context = tls(info)
    return openai.OpenAI(
        base_url=info["endpoint"], api_key=info["api_key"] if key is None else key,
        max_retries=0, timeout=timeout,
        http_client=openai.DefaultHttpxClient(verify=context) if context else None)


def http_status(url: str, headers: dict | None = None, context=None, timeout=10) -> int:
    """The HTTP status URL answers (an error status too)."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}),
                                    timeout=timeout, context=context) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def playbook(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "ansible-playbook"), *args], cwd=ROOT,
                          capture_output=True, text=True, env=ENV, timeout=900, check=False)


def runner_job(private_dir: Path, inventory: str, *cmdline: str, playbook_name="site.yml"):
    """The playbook as AWX and Automation Platform run a job: through ansible-runner's
    Python API, the repository as the project directory (its ansible.cfg read from there),
    the job's own private data directory. (status, rc, output, started, ended): the wall
    clock at its start and end, to show jobs side by side."""
    import ansible_runner

    private_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    run = ansible_runner.run(
        private_data_dir=str(private_dir), project_dir=str(ROOT), playbook=playbook_name,
        inventory=inventory, cmdline=" ".join(cmdline) or None, quiet=True, timeout=900,
        envvars={"PATH": ENV["PATH"], "NO_COLOR": "1", "ANSIBLE_FORCE_COLOR": "0",
                 "ANSIBLE_STDOUT_CALLBACK": "gpufleet.fleet.gpufleet"})
    return run.status, run.rc, run.stdout.read(), started, time.time()


def ssh(host: str, command: str, check: bool = False) -> str:
    proc = subprocess.run(lab_hosts.ssh_cmd(host, command), capture_output=True, text=True,
                          timeout=120, check=False)
    assert not check or proc.returncode == 0, f"{host}: {command}: {proc.stderr}"
    return proc.stdout


def main_pids(host: str, units: str = "'gpufleet-*.service'") -> dict[str, str]:
    """unit -> main PID of the running units among UNITS (a restart changes the PID); the
    health checker's oneshot, which its timer starts and ends, is left out."""
    out = ssh(host, f"systemctl show -p Id -p MainPID {units}", check=True)
    pids = {}
    for block in out.strip().split("\n\n"):
        fields = dict(line.split("=", 1) for line in block.splitlines() if "=" in line)
        if fields.get("MainPID", "0") != "0" and fields["Id"] != "gpufleet-health.service":
            pids[fields["Id"]] = fields["MainPID"]
    return pids


def recap(output: str) -> dict[str, dict[str, int]]:
    """PLAY RECAP counters per host."""
    out = {}
    for host, counters in re.findall(r"^(\S+)\s+:\s+(ok=.*)$", output, re.M):
        out[host] = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", counters)}
    return out


def changed_tasks(output: str, host: str) -> list[str]:
    """Names of the tasks that reported a change on host (for failure messages)."""
    blocks = re.split(r"^TASK \[", output, flags=re.M)[1:]
    return [b.split("]", 1)[0] for b in blocks
            if re.search(rf"^changed: \[{re.escape(host)}\b", b, re.M)]


HOSTS = ("lab1", "lab2")
# Everything gpufleet writes on a host (path, size, mtime, mode, owner; directories
# without mtime, which a file replaced inside them moves) plus the content of /etc.
# The health timer's own state is left out: it runs every 15 s in the lab and
# rewrites it by design. DIGEST is its hash.
LISTING = (
    "{ find /etc /opt/gpufleet /var/lib/gpufleet /usr/local/lib/gpufleet /var/cache/gpufleet/hf"
    " -xdev \\( -name 'health-state.json*' -o -name '.health-state.json.tmp*' \\) -prune"
    " -o -type d -printf '%p/ %m %u:%g\\n' -o -printf '%p %s %T@ %m %u:%g\\n' 2>/dev/null"
    " | sort;"
    " find /etc -xdev -type f -exec sha256sum {} + 2>/dev/null | sort; }"
)
DIGEST = LISTING + " | sha256sum"


def digests(hosts=HOSTS) -> dict[str, str]:
    """host -> digest of its gpufleet files; equal before and after = nothing changed."""
    return {h: ssh(h, DIGEST, check=True).split()[0] for h in hosts}


def listing_diff(host: str, before: str, ignore: str = "^$") -> str:
    """What changed on host since LISTING gave before (empty: nothing), leaving out the
    paths that match ignore (a regular expression)."""
    after = ssh(host, LISTING, check=True)
    keep = [[line for line in text.splitlines() if not re.match(ignore, line)]
            for text in (before, after)]
    return "\n".join(difflib.unified_diff(*keep, "before", "after", lineterm="", n=0))


def lab_inventory(tmp_path: Path, all_vars: dict | None = None, host_vars: dict | None = None,
                  groups: dict | None = None) -> str:
    """A copy of the lab's inventory with variables changed (None removes one), hosts
    added or changed, or the groups replaced; returns its path."""
    dst = tmp_path / "inventory"
    shutil.copytree(ROOT / "inventories" / "lab", dst)
    hosts = yaml.safe_load((dst / "hosts.yml").read_text())
    lab_hosts = hosts["all"]["children"]["lab"]["hosts"]
    for name, values in (host_vars or {}).items():
        base = lab_hosts.setdefault(name, dict(lab_hosts["lab1"]))
        for key, value in values.items():
            if value is None:
                base.pop(key, None)
            else:
                base[key] = value
    for group, members in (groups or {}).items():
        hosts["all"]["children"][group] = {"hosts": {h: {} for h in members}}
    (dst / "hosts.yml").write_text(yaml.safe_dump(hosts))
    group_vars = yaml.safe_load((dst / "group_vars" / "all.yml").read_text())
    for key, value in (all_vars or {}).items():
        if value is None:
            group_vars.pop(key, None)
        else:
            group_vars[key] = value
    (dst / "group_vars" / "all.yml").write_text(yaml.safe_dump(group_vars))
    return str(dst)


def env_client(inv: str, timeout: float = 30) -> openai.OpenAI:
    """The real OpenAI client as a user sets it up from `fab endpoint --format env`."""
    out = fab("endpoint", "-i", inv, "--format", "env")
    assert out.returncode == 0, out.stderr
    env = dict(line.split("=", 1) for line in out.stdout.split())
    return openai.OpenAI(base_url=env["OPENAI_BASE_URL"], api_key=env["OPENAI_API_KEY"],
                         max_retries=0, timeout=timeout, http_client=openai.DefaultHttpxClient(
                             verify=ssl.create_default_context(cafile=env["SSL_CERT_FILE"])))


def requests_finished(address: str, port: int) -> float:
    """Requests a vLLM engine finished (vllm:request_success_total, every reason), read from
    its /metrics at address:port."""
    with urllib.request.urlopen(f"http://{address}:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(v) for v in
               re.findall(r"^vllm:request_success_total\{.*\} (\S+)$", text, re.M))
