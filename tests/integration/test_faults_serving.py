"""Faults while serving and while deploying, each with a measured outcome.

kill -9 of the router, the gateway and the health checker; decode stopped under a
live router (requests fail fast with a clear status, none hang); the cache filesystem
filling up; the fabric manager stopping; a deploy killed at every play boundary and
in the middle of the serve play; a decode host that drops off the network in the
middle of a deploy. Each test prints what the operator sees and how long it took.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.request

import openai
import pytest
from labutil import (
    BIN,
    ENV,
    LISTING,
    ROOT,
    api_client,
    changed_tasks,
    fab,
    listing_diff,
    playbook,
    recap,
    ssh,
)
from labutil import endpoint as lab_endpoint

from gpufleet_lab import hosts, net

pytestmark = pytest.mark.lab

TARGET = "h200-pd-1node"
ENGINES = ["gpufleet-prefill.service", "gpufleet-decode.service"]
MODEL = "zai-org/GLM-5.3-Flash"


def units() -> dict[str, dict]:
    proc = fab("status", "--target", TARGET, "--format", "json")
    return {u["unit"]: u for u in json.loads(proc.stdout)["units"]}


def health() -> tuple[int, list[dict]]:
    proc = fab("health", "--format", "json")
    checks = [dict(c, host=h) for h, r in json.loads(proc.stdout)["hosts"].items()
              for c in r.get("checks", [])]
    return proc.returncode, checks


def wait(predicate, timeout: float, step: float = 1.0):
    """predicate's first truthy value; an API error counts as not yet."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except openai.APIError:
            value = None
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"not within {timeout}s")


@pytest.fixture(scope="module")
def endpoint(lab):
    proc = fab("deploy", "--target", TARGET)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    return lab_endpoint()


def ask(endpoint, timeout=30):
    c = api_client(endpoint, timeout=timeout)
    return c.chat.completions.create(model=MODEL, max_tokens=16,
                                     messages=[{"role": "user", "content": "Say READY"}])


@pytest.mark.parametrize("unit", ["gpufleet-router.service", "gpufleet-gateway.service"])
def test_kill_9_of_a_front_process_is_back_within_seconds(endpoint, unit):
    pid = units()[unit]["main_pid"]
    t0 = time.monotonic()
    ssh("lab1", f"kill -9 {pid}", check=True)

    wait(lambda: ask(endpoint, timeout=5).choices[0].finish_reason, 60, 0.2)
    print(f"{unit}: killed, serving again after {time.monotonic() - t0:.1f}s")
    assert units()[unit]["main_pid"] != pid
    assert units()[unit]["restarts"] >= 1


def test_kill_9_of_the_health_checker_mid_run_leaves_its_files_whole(endpoint):
    """The checker killed at 30 points of its run (0 to 290 ms in): its state file and
    metrics always parse, and the next run is healthy."""
    run = ("/usr/bin/python3 -I -B /usr/local/lib/gpufleet/healthcheck.py "
           "--config /etc/gpufleet/health.json")
    out = ssh("lab1", "for ms in $(seq 0 10 290); do " + run + " >/dev/null 2>&1 & pid=$!; "
                      "sleep $(printf '0.%03d' $ms); kill -9 $pid 2>/dev/null; wait $pid; "
                      "python3 -c 'import json; json.load(open("
                      "\"/var/lib/gpufleet/health-state.json\"))' || echo BROKEN; done; "
                      + run + " >/dev/null; echo done", check=True)
    assert out.strip().endswith("done") and "BROKEN" not in out, out
    state = json.loads(ssh("lab1", "cat /var/lib/gpufleet/health-state.json"))
    assert "gpufleet-decode.service" in state["units"]
    metrics = ssh("lab1", "cat /var/lib/prometheus/node-exporter/gpufleet.prom")
    assert re.search(r"^gpufleet_health_ok(\{[^}]*\})? 1$", metrics, re.M), metrics
    assert health()[0] == 0


def test_requests_fail_fast_and_clearly_while_decode_restarts(endpoint):
    ssh("lab1", "systemctl stop gpufleet-decode.service", check=True)
    try:
        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as err:
            ask(endpoint, timeout=60)
        took = time.monotonic() - t0
        print(f"decode down: HTTP {err.value.status_code} after {took:.2f}s: "
              f"{str(err.value)[:120]}")
        assert err.value.status_code >= 500 and took < 15
        code, checks = health()
        assert code == 1
        assert any(c["unit"] == "gpufleet-decode.service" and c["status"] == "fail"
                   for c in checks)
    finally:
        ssh("lab1", "systemctl start gpufleet-decode.service", check=True)
    wait(lambda: ask(endpoint).choices[0].finish_reason, 60)
    wait(lambda: health()[0] == 0, 60, 3)


def test_the_cache_filesystem_filling_up_is_reported_and_serving_goes_on(endpoint):
    cache = "/var/cache/gpufleet/hf"
    free = int(ssh("lab1", f"df --output=avail -B1 {cache} | tail -1"))
    ssh("lab1", f"fallocate -l {free - 2 * 2**30} {cache}/.fill", check=True)
    try:
        code, checks = health()
        cache_check = next(c for c in checks if c["check"] == "cache")
        print(f"cache full: {cache_check['detail']}")
        assert code == 1 and cache_check["status"] == "fail"
        assert "GiB free (minimum" in cache_check["detail"]
        assert ask(endpoint).choices[0].finish_reason  # serving is not affected
        # a re-deploy needs no room: the checkpoint is complete in the cache
        check = fab("deploy", "--target", TARGET, "--check")
        assert check.returncode == 0, check.stdout[-3000:]
    finally:
        ssh("lab1", f"rm -f {cache}/.fill", check=True)
    assert health()[0] == 0


def test_the_fabric_manager_stopping_is_named_with_the_fix(endpoint):
    ssh("lab1", "systemctl stop nvidia-fabricmanager.service", check=True)
    try:
        code, checks = health()
        fm = next(c for c in checks if c["unit"] == "nvidia-fabricmanager.service")
        print(f"fabric manager stopped: {fm['detail']}")
        assert code == 1 and fm["status"] == "fail"
        assert "Fix: start it (systemctl start nvidia-fabricmanager.service" in fm["detail"]
        assert ask(endpoint).choices[0].finish_reason
    finally:
        ssh("lab1", "systemctl start nvidia-fabricmanager.service", check=True)
    assert health()[0] == 0


WATCH_LATENCY_S = 5  # the goal: a host fault in the metrics within seconds


def check_ok(host: str, check: str) -> str:
    """gpufleet_health_check_ok of a host check in the host's metrics file, as written."""
    text = ssh(host, "cat /var/lib/prometheus/node-exporter/gpufleet.prom")
    found = re.search(rf'^gpufleet_health_check_ok{{check="{check}",unit=""}} (\S+)$', text, re.M)
    return found.group(1) if found else "absent"


def test_the_watcher_puts_a_host_fault_in_the_metrics_within_seconds(endpoint):
    """gpufleet-health-watch: a GPU fault (the fabric's status, read below nvidia-smi) and a
    fatal Xid in the kernel journal are in lab1's metrics within 5 s; fab health names them
    with the GPU and the action, fab status names the host sick; the engines are stopped
    (drained: out of the router's pool), never restarted; once the fault is gone and the
    Xid cleared (after the GPU reset), even with the checker's state file lost, they start
    again and the host is healthy again."""
    assert ssh("lab1", "systemctl is-active gpufleet-health-watch.service").strip() == "active"
    restarts = {u: s["restarts"] for u, s in units().items()}
    xml = ssh("lab1", "nvidia-smi -q -x")
    pci = re.search(r'<gpu id="0000(\w{4}:\w\w:\w\w)\.0">', xml).group(1)
    faults = (
        ("fabric status", "gpu_fabric", lambda: ssh(
            "lab1", "echo '{\"xml\": {\"3\": {\"status\": \"Insufficient Resources\"}}}' "
            "> /var/lib/gpufleet-lab/gpu-faults.json", check=True)),
        ("fatal Xid", "gpu_xid", lambda: hosts.kernel_message(
            "lab1", f"NVRM: Xid (PCI:{pci}): 79, pid=0, GPU has fallen off the bus.")),
    )
    try:
        for name, check, inject in faults:
            assert check_ok("lab1", check) == "1"
            started = time.monotonic()
            inject()
            wait(lambda c=check: check_ok("lab1", c) == "0", WATCH_LATENCY_S, 0.1)
            print(f"{name}: in lab1's metrics after {time.monotonic() - started:.1f}s")
        code, checks = health()
        # the host's checks; the units' fail too once the engines are stopped (drained)
        failing = {c["check"]: c["detail"] for c in checks
                   if c["status"] == "fail" and not c["unit"]}
        assert code == 1 and set(failing) == {"gpu_fabric", "gpu_xid"}, failing
        assert re.search(r"Xid 79 on GPU 0 \(GPU-\S+, 0000" + pci + r"\.0\) .*Action: the GPU "
                         "fell off the bus: reboot the host", failing["gpu_xid"])
        assert "GPU 3 (" in failing["gpu_fabric"] and "Action:" in failing["gpu_fabric"]
        log = ssh("lab1", "journalctl -u gpufleet-health-watch -o cat --no-pager")
        assert "watch: running the host checks (Xid in the kernel log)" in log
        assert "watch: running the host checks (gpu)" in log
        status = fab("status", "--target", TARGET, "--format", "json")
        assert status.returncode == 1
        sick = json.loads(status.stdout)["sick"]["lab1"]
        assert sick["checks"] == ["gpu_fabric", "gpu_xid"]
        assert sick["drained"] == ENGINES, sick
        assert "lab1: SICK since " in fab("status", "--target", TARGET).stdout
        now = units()
        assert {u: s["restarts"] for u, s in now.items()} == restarts
        assert {u: now[u]["active"] for u in ENGINES} == dict.fromkeys(ENGINES, "inactive")
        assert now["gpufleet-router.service"]["active"] == "active"  # not an engine
        drained = ssh("lab1", "grep ^gpufleet_unit_drained /var/lib/prometheus/node-exporter/"
                      "gpufleet.prom")
        assert 'gpufleet_unit_drained{unit="gpufleet-decode.service"} 1' in drained, drained
    finally:
        # the GPU reset: the Xid cleared; the lab's kernel messages go too, so that a later
        # module's fresh checker (no journal cursor after a teardown) does not find it
        hosts.clear_kernel_messages("lab1")
        ssh("lab1", "rm -f /var/lib/gpufleet-lab/gpu-faults.json; /usr/bin/python3 -I -B "
            "/usr/local/lib/gpufleet/healthcheck.py --clear-xid all", check=True)
    # the state file lost meanwhile (under the checker's lock: no run writes it back): the
    # drained engines are read back from systemd, and after the runs in a row that pass
    # (the watcher's on the fabric change, the timer's) they start again
    ssh("lab1", "flock /var/lib/gpufleet/health-state.json.lock "
                "rm -f /var/lib/gpufleet/health-state.json", check=True)
    wait(lambda: health()[0] == 0, 150, 3)
    log = ssh("lab1", "journalctl -u gpufleet-health -u gpufleet-health-watch -o cat "
                      "--no-pager")
    assert "the state file was lost: taking the enabled, stopped engines as drained: " + \
        ", ".join(ENGINES) in log, log[-3000:]
    wait(lambda: check_ok("lab1", "gpu_fabric") == "1", 10, 0.5)
    assert all(units()[u]["ready"] for u in ENGINES)


def test_node_exporter_serves_the_health_metrics_when_asked_for(endpoint):
    """Optional: the distribution's node_exporter, whose textfile collector reads where the
    checker writes; a Prometheus server scrapes the lab host as it would a real one."""
    run = playbook("-i", "inventories/lab", "playbooks/health.yml",
                   "-e", "gpufleet_target=" + TARGET, "-e", "gpufleet_node_exporter=true")
    assert run.returncode == 0, run.stdout[-3000:]
    assert ssh("lab1", "dpkg-query -W -f '${Status}' prometheus-node-exporter") == \
        "install ok installed"
    assert ssh("lab1", "systemctl is-enabled prometheus-node-exporter").strip() == "enabled"
    address = net.host_address(1)  # lab1
    with urllib.request.urlopen(f"http://{address}:9100/metrics", timeout=10) as resp:
        text = resp.read().decode()
    assert re.search(r"^gpufleet_health_ok 1$", text, re.M), text[-2000:]
    assert re.search(r'^gpufleet_health_check_ok\{check="gpu_pcie",unit=""\} 1$', text, re.M)
    again = playbook("-i", "inventories/lab", "playbooks/health.yml",
                     "-e", "gpufleet_target=" + TARGET, "-e", "gpufleet_node_exporter=true")
    assert again.returncode == 0 and recap(again.stdout)["lab1"]["changed"] == 0, \
        again.stdout[-3000:]


# ------------------------------------------------------------------ interrupted deploys

def deploy_killed_at(marker: str, *args: str) -> str:
    """Run `fab deploy`, SIGKILL it (and Ansible) when a line starts with marker."""
    proc = subprocess.Popen([str(BIN / "fab"), "deploy", "--target", TARGET, *args], cwd=ROOT,
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if line.startswith(marker):
                os.killpg(proc.pid, signal.SIGKILL)
                break
    finally:
        proc.wait(timeout=600)
    assert seen and seen[-1].startswith(marker), "".join(seen[-40:])
    return "".join(seen)


@pytest.mark.slow
def test_a_deploy_killed_at_every_play_boundary_then_rerun_converges(endpoint):
    fab("teardown", "--target", TARGET)
    plays = ["PLAY [Prepare", "PLAY [Cache", "PLAY [Serve", "PLAY [Smoke", "PLAY [Health"]
    t0 = time.monotonic()
    for marker in plays:
        deploy_killed_at(marker)
        # nothing half-written: no temporary files next to what Ansible writes
        left = ssh("lab1", "find /etc/gpufleet /etc/systemd/system /var/lib/gpufleet "
                           "-name '.ansible_tmp*' -o -name '*.tmp.*' 2>/dev/null")
        assert left.strip() == "", left
    proc = fab("deploy", "--target", TARGET)
    assert proc.returncode == 0, proc.stdout[-3000:]
    print(f"{len(plays)} interrupted deploys and a full one: {time.monotonic() - t0:.0f}s")
    again = fab("deploy", "--target", TARGET)
    assert recap(again.stdout)["lab1"]["changed"] == 0, changed_tasks(again.stdout, "lab1")


@pytest.mark.slow
def test_a_change_written_but_not_applied_by_a_killed_deploy_is_applied_by_the_rerun(endpoint):
    flag = ["--set", "decode:--max-num-seqs=128"]
    deploy_killed_at("TASK [gpufleet.fleet.serve : Serve | Configure | Read the pending "
                     "restarts]", *flag)
    # the unit file has the new flag, the running process does not yet
    assert "--max-num-seqs 128" in ssh("lab1", "systemctl cat gpufleet-decode.service")
    pid = units()["gpufleet-decode.service"]["main_pid"]
    assert "128" not in ssh("lab1", f"tr '\\0' ' ' < /proc/{pid}/cmdline")
    proc = fab("deploy", "--target", TARGET, *flag)
    assert proc.returncode == 0, proc.stdout[-3000:]
    pid = units()["gpufleet-decode.service"]["main_pid"]
    assert "--max-num-seqs 128" in ssh("lab1", f"tr '\\0' ' ' < /proc/{pid}/cmdline")
    assert ssh("lab1", "ls /var/lib/gpufleet/restart-pending").strip() == ""
    fab("deploy", "--target", TARGET)  # back to the catalog's settings


@pytest.mark.slow
def test_a_decode_host_dropping_off_mid_deploy_is_named_and_a_rerun_converges(lab):
    target, flag = "sglang-h200-pd", ["--set", "decode:--max-running-requests=128"]
    proc = fab("deploy", "--target", target)
    assert proc.returncode == 0, proc.stdout[-3000:]
    lab1_before = ssh("lab1", LISTING, check=True)
    pids = ssh("lab1", "systemctl show -p MainPID --value gpufleet-prefill gpufleet-router")
    link = net.host_link("lab2")
    t0 = time.monotonic()
    run = subprocess.Popen([str(BIN / "fab"), "deploy", "--target", target, *flag], cwd=ROOT,
                           env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = []
    try:
        for line in run.stdout:
            out.append(line)
            if line.startswith("PLAY [Serve"):
                net.ip("link", "set", link, "down", ns=net.LAB_NS)
        run.wait(timeout=600)
    finally:
        net.ip("link", "set", link, "up", ns=net.LAB_NS)
    text = "".join(out)
    print(f"lab2 dropped off: deploy failed after {time.monotonic() - t0:.0f}s")
    assert run.returncode == 1
    assert "lab2" in text and "UNREACHABLE" in text
    assert "Fix: check that the host is up" in text
    # the host that stayed was left as it was, and its processes kept running
    # (the checkpoint's fetch host re-verifies the shared cache before the serve plays, as
    # any deploy that changes a host does, and rewrites that run's progress file)
    changed = listing_diff("lab1", lab1_before, ignore=r"/var/lib/gpufleet/cache-fetch/")
    assert not changed, changed[-3000:]
    assert ssh("lab1", "systemctl show -p MainPID --value gpufleet-prefill "
                       "gpufleet-router") == pids
    proc = fab("deploy", "--target", target, *flag)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "--max-running-requests 128" in ssh("lab2", "systemctl cat gpufleet-decode.service")
