"""An engine release change is one rolling deploy (gpufleet_engine_versions): a pool of two
vLLM workers (gb200-tray, one on each of two GB200 lab hosts, behind the gateway and two
vllm-routers) moves from vLLM 0.31.0 to 0.33.0 under load and back, losing no request.
The new release's environment is installed beside the old one before any worker stops;
going back installs nothing; each worker reports the release the plan runs."""

from __future__ import annotations

import json
import ssl
import time

import pytest
from labutil import changed_tasks, fab, lab_inventory, ssh
from openai import DefaultHttpxClient, OpenAI
from test_scale_out import errors, under_load

from gpufleet_lab import hosts as lab_hosts
from gpufleet_lab import net

pytestmark = [pytest.mark.lab, pytest.mark.slow]  # about 10 minutes, on two GB200 hosts

HOSTS = ("lab1", "lab2")
VENVS = "/opt/gpufleet/engines"
INSTALL = "Engine runtime | Install | pip install exactly the lock (hashes checked, wheels only)"


@pytest.fixture(scope="module")
def trays(_lab_session):
    """Two GB200 lab hosts for this module; the lab's two H200 hosts again after it."""
    lab_hosts.up(hosts=2, profiles=["gb200x4"])
    yield
    lab_hosts.up(hosts=2)


def inventory(tmp_path, version: str) -> str:
    return lab_inventory(tmp_path / version, {
        "gpufleet_target": "gb200-tray", "gpufleet_workers": {"worker": 2},
        "gpufleet_engine_versions": {"vllm": version}}, groups={"workers": list(HOSTS)})


def releases() -> dict[str, str]:
    """Each worker's release, as its own API reports it (GET /version)."""
    out = {}
    for i, host in enumerate(HOSTS, start=1):
        body = ssh(host, f"curl -s http://{net.host_address(i)}:8001/version", check=True)
        out[host] = json.loads(body)["version"]
    return out


def deploy(inv: str, client, what: str):
    """fab deploy under load: it passes and not one request fails."""
    started = time.monotonic()
    proc, results = under_load(client, lambda: fab("deploy", "-i", inv))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    failed = results.count(False)
    print(f"{what} under load: {failed} of {len(results)} failed, "
          f"{time.monotonic() - started:.0f} s")
    assert len(results) > 50 and failed == 0, (failed, len(results), errors())
    return proc


def test_a_pool_moves_to_another_release_under_load_and_back(trays, tmp_path):
    older, newer = inventory(tmp_path, "0.31.0"), inventory(tmp_path, "0.33.0")
    first = fab("deploy", "-i", older)
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-2000:]
    assert releases() == {h: "0.31.0" for h in HOSTS}
    env = dict(line.split("=", 1) for line in
               fab("endpoint", "-i", older, "--format", "env").stdout.split())
    client = OpenAI(base_url=env["OPENAI_BASE_URL"], api_key=env["OPENAI_API_KEY"],
                    max_retries=0, timeout=30, http_client=DefaultHttpxClient(
                        verify=ssl.create_default_context(cafile=env["SSL_CERT_FILE"])))
    try:
        # up: 0.33.0's environment is installed (beside 0.31.0's) before a worker stops,
        # then the workers roll onto it one at a time
        up = deploy(newer, client, "0.31.0 -> 0.33.0")
        assert releases() == {h: "0.33.0" for h in HOSTS}
        for host in HOSTS:
            assert any(INSTALL in t for t in changed_tasks(up.stdout, host)), host
            assert set(ssh(host, f"ls {VENVS}").split()) >= {"vllm-0.31.0", "vllm-0.33.0"}
            unit = ssh(host, "cat /etc/systemd/system/gpufleet-worker*.service", check=True)
            assert f"{VENVS}/vllm-0.33.0/bin/vllm serve" in unit and "vllm-0.31.0" not in unit
        # every host's install before the first worker stops (the serve play comes later)
        assert up.stdout.rindex(INSTALL) < up.stdout.index("Roll | Restart, batch")

        # back: the old environment is still there; nothing is installed, the workers roll
        back = deploy(older, client, "0.33.0 -> 0.31.0")
        assert releases() == {h: "0.31.0" for h in HOSTS}
        for host in HOSTS:
            assert not any(INSTALL in t for t in changed_tasks(back.stdout, host)), host
        assert "Roll | Restart, batch" in back.stdout
    finally:
        down = fab("teardown", "-i", older)
        assert down.returncode == 0, down.stdout[-3000:]
