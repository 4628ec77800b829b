"""Exposure, secrets, check mode and idempotence on a real deployment in the lab.

The endpoint serves HTTPS only, with the deployment's own CA (kept like the key), and needs
the API key (the real openai client is refused without it), the
processes listen where the plan says and nowhere else, the units' systemd exposure
scores stay under the goals, the key appears in no log, process listing, environment
or world-readable file, and `--check --diff` and re-runs change nothing.
"""

from __future__ import annotations

import json
import os
import re
import ssl
import stat
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from labutil import (
    HOSTS,
    ROOT,
    api_client,
    digests,
    fab,
    http_status,
    playbook,
    recap,
    ssh,
    tls,
)

pytestmark = pytest.mark.lab

TARGET = "h200-pd-1node"
MODEL = "zai-org/GLM-5.3-Flash"
# systemd-analyze security goals per unit kind (issue 7)
EXPOSURE_GOAL = {"router": 3.0, "gateway": 3.0, "metrics": 3.0, "prefill": 6.0, "decode": 6.0}


@pytest.fixture(scope="module")
def deployed(lab):
    proc = fab("deploy", "--target", TARGET, env={"ANSIBLE_VERBOSITY": "3"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    endpoint = json.loads(fab("endpoint", "--format", "json").stdout)
    return {"deploy_output": proc.stdout + proc.stderr, **endpoint}


def client(deployed, key):
    return api_client(deployed, key, timeout=20)


def test_the_endpoint_refuses_requests_without_the_key(deployed):
    url, key = deployed["endpoint"], deployed["api_key"]
    assert re.fullmatch(r"[A-Za-z0-9_-]{48}", key)  # gpufleet.apikey: 36 random bytes
    for wrong in ("EMPTY", key[:-1], key + "x", key.swapcase()):
        with pytest.raises(openai.AuthenticationError) as err:
            client(deployed, wrong).models.list()
        assert "fab endpoint" in str(err.value)
    assert [m.id for m in client(deployed, key).models.list()] == [MODEL]
    reply = client(deployed, key).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say READY"}], max_tokens=16)
    assert reply.choices[0].finish_reason in ("stop", "length")
    # Anthropic-style clients send x-api-key
    assert http_status(url + "/models", {"x-api-key": key}, tls(deployed)) == 200
    # load balancers probe /health without a key
    assert http_status(url.removesuffix("/v1") + "/health", context=tls(deployed)) == 200


def test_the_endpoint_serves_https_only_with_the_deployments_ca(deployed):
    url, ca = deployed["endpoint"], deployed["ca_file"]
    assert url == "https://10.213.77.11:8000/v1" and "tls:      HTTPS; clients verify it " \
        f"with the CA {ca}" in deployed["deploy_output"]
    assert stat.S_IMODE(os.stat(ca).st_mode) == 0o600
    key_file = ca.removesuffix(".crt") + ".key"
    assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600
    # a client that trusts only the system's CAs refuses the certificate: the CA is ours
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        http_status(url.removesuffix("/v1") + "/health", context=ssl.create_default_context())
    # plain HTTP on the port gets 400, never an answer
    assert http_status(url.replace("https://", "http://") + "/models",
                       {"Authorization": f"Bearer {deployed['api_key']}"}) == 400
    # the certificate names the host and its address, and nginx serves it
    served = ssh("lab1", "echo | openssl s_client -connect 10.213.77.11:8000 "
                         "-CAfile /etc/gpufleet/gateway/ca.crt -verify_ip 10.213.77.11 "
                         "2>/dev/null | grep -E 'Verify return code|subject='")
    assert "Verify return code: 0 (ok)" in served, served
    for path, mode in (("tls.key", "640"), ("tls.crt", "644"), ("ca.crt", "644")):
        assert ssh("lab1", f"stat -c '%a %U %G' /etc/gpufleet/gateway/{path}").split() == \
            [mode, "root", "gpufleet"], path
    assert Path(ca).read_text().strip() == ssh("lab1", "cat /etc/gpufleet/gateway/ca.crt").strip()


def test_a_controller_without_the_certificate_keeps_the_gateways(deployed):
    """A new clone or a fresh HOME: the deploy keeps the certificate clients trust, it
    does not make a new CA, and the gateway is not restarted."""
    ca = deployed["ca_file"]
    before = Path(ca).read_text()
    pid = ssh("lab1", "systemctl show -p MainPID --value gpufleet-gateway.service").strip()
    os.unlink(ca)
    os.unlink(ca.removesuffix(".crt") + ".key")
    again = playbook("-i", "inventories/lab", "playbooks/serve.yml", "-e",
                     f"gpufleet_target={TARGET}")
    assert again.returncode == 0, again.stdout[-4000:]
    assert Path(ca).read_text() == before and stat.S_IMODE(os.stat(ca).st_mode) == 0o600
    assert ssh("lab1", "systemctl show -p MainPID --value gpufleet-gateway.service").strip() \
        == pid
    assert http_status(deployed["endpoint"] + "/models", context=tls(deployed)) == 401


def test_the_key_is_kept_0600_on_the_controller(deployed):
    path = deployed["api_key_file"]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    env = fab("endpoint", "--format", "env").stdout
    assert f"OPENAI_API_KEY={deployed['api_key']}" in env


def listening(host: str) -> list[tuple[str, int, str]]:
    """(address, port, process) of every TCP listener on a lab host."""
    out = []
    for line in ssh(host, "ss -ltnpH", check=True).splitlines():
        fields = line.split()
        address, _, port = fields[3].rpartition(":")
        proc = re.search(r'"([^"]+)"', line)
        out.append((address.strip("[]"), int(port), proc.group(1) if proc else "?"))
    return out


def test_processes_listen_only_where_the_plan_says(deployed):
    plan = json.loads(fab("plan", "--target", TARGET, "-i", "inventories/lab",
                          "--format", "json").stdout)
    ports = {port for p in plan["processes"] for port in p["ports"].values()}
    ours = [(a, port, proc) for a, port, proc in listening("lab1") if port in ports]
    assert ours, "nothing listens on the plan's ports"
    public = [(a, port, proc) for a, port, proc in ours if a not in ("127.0.0.1", "::1")]
    # only the gateway and the metrics listener face the network, on the host's address,
    # not on 0.0.0.0
    assert sorted(public) == [("10.213.77.11", 8000, "nginx"), ("10.213.77.11", 9464, "nginx")], \
        public
    # from another host: the API answers (401 without a key), the engines and the routers'
    # own metrics port do not
    probe = ("python3 -c \"import socket,sys; s=socket.socket(); s.settimeout(3); "
             "print(s.connect_ex(('10.213.77.11', int(sys.argv[1]))))\" ")
    assert ssh("lab2", probe + "8000").strip() == "0"
    for port in sorted(ports - {8000, 9464}):
        assert ssh("lab2", probe + str(port)).strip() != "0", f"port {port} reachable"


def test_the_metrics_listener_serves_only_the_addresses_it_lists(deployed):
    """gpufleet_metrics_allow (the lab's: the controller) gets each process's metrics; a host
    it does not list (lab2) gets 403 for every path."""
    monitoring = json.loads(fab("monitoring", "--format", "json").stdout)
    # the processes, the health checker's file and the site's dcgm-exporter (the lab's)
    assert {g["labels"]["process"] for g in monitoring} == {
        "prefill", "decode", "router", "health", "dcgm-exporter"}
    for group in monitoring:
        url = f"http://{group['targets'][0]}{group['labels']['__metrics_path__']}"
        with urllib.request.urlopen(url, timeout=10) as resp:
            status, body = resp.status, resp.read().decode()
        assert status == 200 and "# TYPE " in body, (url, status, body[:300])
        refused = ssh("lab2", f"curl -s -o /dev/null -w '%{{http_code}}' {url}")
        assert refused == "403", (url, refused)


def exposure(host: str, unit: str) -> float:
    out = ssh(host, f"systemd-analyze security {unit}", check=True)
    return float(re.search(r"Overall exposure level for \S+: ([\d.]+)", out).group(1))


@pytest.mark.parametrize("role", sorted(EXPOSURE_GOAL))
def test_systemd_exposure_score_meets_the_goal(deployed, role):
    score = exposure("lab1", f"gpufleet-{role}.service")
    print(f"exposure gpufleet-{role}.service: {score}")
    assert score <= EXPOSURE_GOAL[role]


def test_the_api_key_leaks_nowhere(deployed):
    key = deployed["api_key"]
    assert key not in deployed["deploy_output"]  # Ansible at -vvv
    health = fab("health", "--format", "json")
    assert health.returncode == 0 and key not in health.stdout + health.stderr
    for host in HOSTS:
        assert key not in ssh(host, "journalctl --no-pager -o cat")
        assert key not in ssh(host, "ps -eo args")
        assert ssh(host, f"grep -l {key} /proc/[0-9]*/environ 2>/dev/null; true").strip() == ""
        files = ssh(host, f"grep -rlF {key} /etc /var /opt /usr/local /tmp /root /home /run "
                          "2>/dev/null; true").split()
        expected = ["/etc/gpufleet/gateway/api-key.conf"] if host == "lab1" else []
        assert files == expected
        for path in files:
            assert ssh(host, f"stat -c '%a %U %G' {path}").split() == ["640", "root", "gpufleet"]
    assert key not in subprocess.run(["ps", "-eo", "args"], capture_output=True,
                                     text=True).stdout
    leaked = subprocess.run(["grep", "-rlF", key, str(ROOT), "/tmp"], capture_output=True,
                            text=True).stdout.split()
    assert leaked == []


def test_check_mode_changes_nothing_and_finds_nothing_to_change(deployed):
    before = digests()
    proc = fab("deploy", "--target", TARGET, "--check")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert {h: c["changed"] for h, c in recap(proc.stdout).items()} == \
        {"lab1": 0, "localhost": 0}
    assert digests() == before


@pytest.mark.slow  # about 25 s each; check mode of site.yml runs in every ./scripts/test
@pytest.mark.parametrize("book", ["playbooks/teardown.yml", "playbooks/restart.yml"])
def test_check_mode_of_the_destructive_playbooks_changes_nothing(deployed, book):
    """They would change things (and say so), but --check leaves every host as it was."""
    before = digests()
    pids = ssh("lab1", "systemctl show -p MainPID --value gpufleet-decode gpufleet-router")
    proc = playbook("-i", "inventories/lab", "playbooks/preflight.yml", book,
                    "--check", "--diff")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert recap(proc.stdout)["lab1"]["changed"] > 0  # honest: it reports what it would do
    assert digests() == before
    assert ssh("lab1", "systemctl show -p MainPID --value gpufleet-decode "
                       "gpufleet-router") == pids


def test_every_playbook_reruns_with_nothing_changed(deployed):
    books = ["playbooks/preflight.yml", "playbooks/prepare.yml", "playbooks/cache.yml",
             "playbooks/serve.yml", "playbooks/health.yml", "playbooks/status.yml",
             "playbooks/health_report.yml"]
    proc = playbook("-i", "inventories/lab", *books)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert recap(proc.stdout)["lab1"]["changed"] == 0
