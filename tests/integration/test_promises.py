"""A deploy proves its promises before it says done, on the shape that once hid an open
endpoint: SGLang's single-node layout (sglang-h200-low-latency), whose worker is what
clients talk to, behind the API gateway.

Deployed, the gateway holds the client port and refuses a request without the key, from
the controller and from another host, and the engine listens on loopback only. Then each
broken promise is injected and the deploy (or its verify play) must fail naming it: a key
the gateway no longer enforces; a stray process answering on the gateway's address and
port while the gateway cannot bind there (the crash loop that once passed as ready).
"""

from __future__ import annotations

import functools
import json
import re
import stat
import time
import urllib.error
from pathlib import Path

import pytest
from labutil import endpoint, fab, http_status, playbook, ssh, tls

pytestmark = pytest.mark.lab

TARGET = "sglang-h200-low-latency"
ENDPOINT = "https://10.213.77.11:30000/v1"
PLAIN = "http://10.213.77.11:30000"  # the same port without TLS (the stray below)
# answers 200 to anything, as an engine or an old process left on the port would
STRAY = ("python3 -c 'import http.server as h; s = h.BaseHTTPRequestHandler; "
         "s.do_GET = lambda r: (r.send_response(200), r.end_headers()); "
         "h.HTTPServer((\"10.213.77.11\", 30000), s).serve_forever()'")


@functools.cache
def _tls():
    return tls(endpoint())


def status(url: str, headers: dict | None = None) -> int:
    """URL's status, an https URL verified with the deployment's CA as a client does."""
    return http_status(url, headers, _tls() if url.startswith("https:") else None)


@pytest.fixture(scope="module")
def deployed(lab):
    proc = fab("deploy", "--target", TARGET)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    return proc


def test_the_gateway_holds_the_port_and_the_engine_listens_on_loopback(deployed):
    assert "Verify | Units | Every unit active, running and not restarted" in deployed.stdout
    assert ssh("lab1", "systemctl is-active gpufleet-gateway.service").strip() == "active"
    assert status(ENDPOINT + "/models") == 401
    # from another host the port is the gateway's too
    # (lab2 has no copy of the CA: -k, the certificate is checked from the controller)
    other = ssh("lab2", f"curl -sk -o /dev/null -w '%{{http_code}}' {ENDPOINT}/models")
    assert other == "401", other
    listening = ssh("lab1", "ss -Hltnp 'sport = :30000'")
    lines = sorted(line.split()[3] for line in listening.splitlines())
    assert lines == ["10.213.77.11:30000", "127.0.0.1:30000"], listening
    assert "nginx" in next(x for x in listening.splitlines() if "10.213.77.11:" in x)


def settles(url: str, code: int, timeout: float = 20) -> int:
    """The status URL answers once it is CODE, or the last one after TIMEOUT seconds (a
    reload or a start is asynchronous: the old workers, or nobody, may answer first)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = status(url)
        except urllib.error.URLError:
            got = 0  # nobody listens yet
        if got == code or time.monotonic() > deadline:
            return got
        time.sleep(0.5)


def keyed(key: str, header: str = "Authorization") -> int:
    value = f"Bearer {key}" if header == "Authorization" else key
    return status(ENDPOINT + "/models", {header: value})


def test_the_gateway_compares_the_key_exactly(deployed):
    key = json.loads(fab("endpoint", "--format", "json").stdout)["api_key"]
    assert keyed(key) == 200 and keyed(key, "x-api-key") == 200
    # what a pattern would have let through: a prefix, a longer key, another case, a
    # pattern's own characters, an empty header
    for wrong in (key[:-1], key + "x", key.swapcase(), ".*", key[:8] + ".*", "", "|"):
        assert keyed(wrong) == 401, wrong
        assert keyed(wrong, "x-api-key") == 401, wrong


def test_a_deploy_from_another_controller_stops_at_the_host_lock(deployed):
    """The deploy released its hosts' lock; another controller's unexpired lock stops a
    deploy before it touches a unit, naming the holder, and the health checker neither
    restarts nor drains meanwhile."""
    assert ssh("lab1", "test -e /run/gpufleet/deploy.lock || echo released").strip() == \
        "released"
    now = int(time.time())
    lock = json.dumps({"holder": "bob@ctl2", "started": now, "expires": now + 600})
    ssh("lab1", f"mkdir -p /run/gpufleet && echo '{lock}' > /run/gpufleet/deploy.lock",
        check=True)
    try:
        # the serve playbook, where the lock is held, as AWX runs it (ansible-playbook)
        refused = playbook("-i", "inventories/lab", "playbooks/serve.yml", "-e",
                           f"gpufleet_target={TARGET}")
        said = " ".join((refused.stdout + refused.stderr).split())
        assert refused.returncode != 0, said[-3000:]
        assert "another deploy holds this host: bob@ctl2 since" in said, said[-3000:]
        assert "TASK [gpufleet.fleet.serve : " not in refused.stdout  # stopped before the role
        checker = json.loads(ssh("lab1", "/usr/bin/python3 -I -B "
                                 "/usr/local/lib/gpufleet/healthcheck.py --json"))
        assert checker["deploying"] == "bob@ctl2", checker
    finally:
        ssh("lab1", "rm -f /run/gpufleet/deploy.lock")


def test_a_controller_without_the_key_keeps_the_one_the_gateway_has(deployed):
    """A new clone, another operator, a job runner with a fresh HOME: the deploy keeps the
    key clients use, it does not rotate it to a new random one."""
    endpoint = json.loads(fab("endpoint", "--format", "json").stdout)
    key, path = endpoint["api_key"], Path(endpoint["api_key_file"])
    path.unlink()
    # the serve playbook (where the key is written), as a job runner runs it
    again = playbook("-i", "inventories/lab", "playbooks/serve.yml", "-e",
                     f"gpufleet_target={TARGET}")
    assert again.returncode == 0, again.stdout[-4000:]
    assert path.read_text().strip() == key and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert keyed(key) == 200


def test_an_empty_key_file_is_refused_before_any_host_changes(deployed):
    endpoint = json.loads(fab("endpoint", "--format", "json").stdout)
    path = Path(endpoint["api_key_file"])
    before = ssh("lab1", "sha256sum /etc/gpufleet/gateway/api-key.conf")
    path.write_text("")
    try:
        refused = fab("deploy", "--target", TARGET)
        said = " ".join((refused.stdout + refused.stderr).split())
        assert refused.returncode == 2, said[-3000:]
        assert "gpufleet_api_key_file" in said and "is empty" in said, said[-3000:]
        assert "PLAY [" not in refused.stdout  # nothing ran on a host
    finally:
        path.write_text(endpoint["api_key"] + "\n")
    assert ssh("lab1", "sha256sum /etc/gpufleet/gateway/api-key.conf") == before
    assert keyed(endpoint["api_key"]) == 200


def test_a_key_the_gateway_no_longer_enforces_fails_the_verify_play(deployed):
    ssh("lab1", "sed -i 's/key_ok 0;/key_ok 1;/' /etc/gpufleet/gateway/api-key.conf && "
                "systemctl reload gpufleet-gateway.service", check=True)
    assert settles(ENDPOINT + "/models", 200) == 200  # injected: open, once reloaded
    run = playbook("-i", "inventories/lab", "site.yml", "-e", f"gpufleet_target={TARGET}",
                   "--tags", "verify")
    said = " ".join(run.stdout.split())
    assert run.returncode != 0, run.stdout[-3000:]
    assert f"{ENDPOINT}/models answered 200 without the API key" in said, run.stdout[-3000:]


def test_a_stray_listener_on_the_gateway_port_fails_the_deploy_then_it_heals(deployed):
    """Another process holds the gateway's port on the host's address and answers /health:
    a deploy is refused by preflight naming it, before any change; the serve playbook alone
    (as a job runner runs it, no preflight) fails naming the gateway, not 'ready'."""
    ssh("lab1", "systemctl stop gpufleet-gateway.service && "
                f"systemd-run --unit=lab-stray --collect {STRAY}", check=True)
    try:
        # the stray answers, once it has started
        assert settles(PLAIN + "/health", 200) == 200
        refused = fab("deploy", "--target", TARGET)
        said = " ".join((refused.stdout + refused.stderr).split())
        assert refused.returncode == 1, refused.stdout[-3000:]  # a host's state, not bad input
        taken = re.search(r"port 30000 is already in use by (.*?)\. Fix", said)
        assert taken and "lab-stray.service" in taken[1], said[-3000:]
        assert "gpufleet-worker" not in taken[1]  # its own worker, on loopback, is no clash
        assert "TASK [gpufleet.fleet.serve" not in refused.stdout  # refused before any change
        broken = playbook("-i", "inventories/lab", "playbooks/serve.yml", "-e",
                          f"gpufleet_target={TARGET}")
        said = " ".join((broken.stdout + broken.stderr).split())
        assert broken.returncode != 0, broken.stdout[-3000:]
        assert "gpufleet-gateway.service" in said and (
            "not (only) from gpufleet-gateway.service" in said or "crashed" in said), \
            broken.stdout[-4000:]
    finally:
        ssh("lab1", "systemctl stop lab-stray.service || true")
    healed = fab("deploy", "--target", TARGET)
    assert healed.returncode == 0, healed.stdout[-4000:]
    assert status(ENDPOINT + "/models") == 401  # the tampered key map was repaired too
    units = json.loads(fab("status", "--format", "json").stdout)["units"]
    assert {u["unit"] for u in units} == {"gpufleet-worker.service",
                                          "gpufleet-gateway.service",
                                          "gpufleet-metrics.service"}
    assert all(u["active"] == "active" for u in units), units
