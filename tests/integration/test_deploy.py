"""The main job on the lab: real systemd hosts, real SSH, real routers.

Deploys one target of each family and proves what an operator relies on: the smoke
test passes through the real router, a re-run changes nothing, one changed flag
restarts one unit, a missing parser is named, a killed engine comes back, a rebooted
host comes back, the health timer writes metrics, and teardown leaves nothing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
from labutil import BIN, ENV, ROOT, changed_tasks, fab, playbook, recap, ssh

from gpufleet_lab import hosts as lab_hosts

sys.path.insert(0, str(ROOT / "tests" / "unit"))
from test_monitoring import DYNAMO  # noqa: E402 - the frontend's names the dashboard reads

pytestmark = pytest.mark.lab


def units(target: str) -> dict[str, dict]:
    proc = fab("status", "--target", target, "--format", "json")
    return {u["unit"]: u for u in json.loads(proc.stdout)["units"]}


def deployed(target: str, *extra: str) -> subprocess.CompletedProcess:
    proc = fab("deploy", "--target", target, *extra)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    return proc


def test_vllm_pd_deploys_and_passes_the_smoke_test(lab):
    proc = deployed("h200-pd-1node")
    assert "models          ok" in proc.stdout and "tool_call       ok" in proc.stdout
    assert "endpoint: https://10.213.77.11:8000/v1" in proc.stdout
    state = units("h200-pd-1node")
    assert {u["active"] for u in state.values()} == {"active"}
    assert all(u["ready"] for u in state.values())
    # the units run what the plan says, as the service user, with pinned env
    show = ssh("lab1", "systemctl show -p User,LimitMEMLOCK gpufleet-prefill.service")
    assert "User=gpufleet" in show and "LimitMEMLOCK=infinity" in show
    env = ssh("lab1", "stat -c '%a %U %G' /etc/gpufleet/env/prefill.env")
    assert env.split() == ["640", "root", "gpufleet"]


def test_fab_logs_prints_and_follows_the_units_journal(lab):
    """The last lines through the status play, and -f over SSH as Ansible connects: the
    history comes, each line led by its host, and Ctrl-C ends it cleanly."""
    proc = fab("logs", "--target", "h200-pd-1node", "--role", "decode", "-n", "5")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "==> lab1 gpufleet-decode.service (active) <==" in proc.stdout
    follower = subprocess.Popen([str(BIN / "fab"), "logs", "--target", "h200-pd-1node",
                                 "--role", "decode", "-n", "5", "-f"], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                # SIGINT at its default, as on a terminal (a run started in
                                # the background inherits it ignored)
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        first = follower.stdout.readline()  # the history comes at once
        assert first.startswith("lab1 | "), first + follower.stderr.read()
    finally:
        follower.send_signal(signal.SIGINT)  # Ctrl-C
        rc = follower.wait(timeout=60)
    assert rc == 0, follower.stderr.read()


def test_ansible_playbook_rerun_changes_nothing_and_restarts_nothing(lab):
    before = units("h200-pd-1node")
    proc = playbook("-i", "inventories/lab", "site.yml")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert recap(proc.stdout)["lab1"]["changed"] == 0, changed_tasks(proc.stdout, "lab1")
    after = units("h200-pd-1node")
    assert {u: s["main_pid"] for u, s in after.items()} == \
        {u: s["main_pid"] for u, s in before.items()}


def test_site_yml_runs_unchanged_under_ansible_runner(lab, tmp_path):
    """AWX and Ansible Automation Platform run playbooks through ansible-runner, with the
    repository as the project directory (its ansible.cfg read from there): through
    ansible-runner's Python API, site.yml on the lab inventory succeeds, the smoke test
    passes, and on the deployment fab deploy made nothing changes (it runs before the tests
    that change the deployment)."""
    import ansible_runner

    run = ansible_runner.run(
        private_data_dir=str(tmp_path), project_dir=str(ROOT), playbook="site.yml",
        inventory=str(ROOT / "inventories" / "lab"), quiet=True,
        envvars={"PATH": f"{BIN}:{os.environ['PATH']}"})
    output = run.stdout.read()
    assert (run.status, run.rc) == ("successful", 0), output[-4000:]
    assert run.stats["failures"] == {} and run.stats["changed"] == {}, run.stats
    assert "lab1" in run.stats["ok"]
    tasks = {e["event_data"].get("task") for e in run.events if e["event"] == "runner_on_ok"}
    assert "Smoke | Results" in tasks, sorted(t for t in tasks if t)


def test_one_changed_flag_restarts_only_its_unit(lab):
    before = units("h200-pd-1node")
    deployed("h200-pd-1node", "--set", "decode:--max-num-seqs=256")
    after = units("h200-pd-1node")
    moved = {u for u in after if after[u]["main_pid"] != before[u]["main_pid"]}
    assert moved == {"gpufleet-decode.service"}
    assert "--max-num-seqs 256" in ssh("lab1", "systemctl show -p ExecStart gpufleet-decode")


@pytest.mark.slow  # about a minute; tests/unit/test_smoke.py names it without the lab
def test_without_the_tool_call_parser_the_smoke_test_names_it(lab):
    proc = fab("deploy", "--target", "h200-pd-1node", "--unset", "engines:--tool-call-parser",
               "--unset", "engines:--enable-auto-tool-choice")
    assert proc.returncode == 1
    assert "tool_call failed" in proc.stdout and "--tool-call-parser glm47" in proc.stdout


# --slow (about 90 s): test_scale_out kills a decode worker and sees it back in its pool, and
# test_image_runtime kills a containerized engine and sees health green again, every run
@pytest.mark.slow
def test_a_killed_engine_is_restarted_and_health_returns_to_green(lab):
    deployed("h200-pd-1node")
    pid = units("h200-pd-1node")["gpufleet-decode.service"]["main_pid"]
    ssh("lab1", f"kill -9 {pid}")
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        state = units("h200-pd-1node")["gpufleet-decode.service"]
        if state["main_pid"] not in (0, pid) and state["ready"]:
            break
        time.sleep(3)
    assert state["restarts"] >= 1 and state["ready"], state
    proc = fab("health", "--target", "h200-pd-1node")
    assert proc.returncode == 0, proc.stdout


def test_rolling_restart_of_one_role(lab):
    """...after the checkpoint's branch moved (a later cache run): the engines name the
    commit the deploy pinned, so the restarted decode loads the weights prefill serves."""
    plan = json.loads(fab("plan", "--target", "h200-pd-1node", "--format", "json").stdout)
    ref = f"{plan['cache']['hub']}/models--zai-org--GLM-5.3-Flash/refs/main"
    commit = ssh("lab1", f"cat {ref}", check=True).strip()
    for unit in ("prefill", "decode"):
        start = ssh("lab1", f"systemctl show -p ExecStart --value gpufleet-{unit}", check=True)
        assert f" --revision {commit} " in start, start
    before = units("h200-pd-1node")
    ssh("lab1", f"cp -p {ref} {ref}.kept && echo {'f' * 40} > {ref}", check=True)
    try:
        proc = fab("restart", "--role", "decode", "--target", "h200-pd-1node")
    finally:
        ssh("lab1", f"mv {ref}.kept {ref}", check=True)
    assert proc.returncode == 0, proc.stdout[-3000:]
    after = units("h200-pd-1node")
    moved = {u for u in after if after[u]["main_pid"] != before[u]["main_pid"]}
    assert moved == {"gpufleet-decode.service"} and after["gpufleet-decode.service"]["ready"]


def test_the_health_timer_writes_metrics(lab):
    path = "/var/lib/prometheus/node-exporter/gpufleet.prom"
    first = ssh("lab1", f"stat -c %Y {path}").strip()
    deadline = time.monotonic() + 60
    while ssh("lab1", f"stat -c %Y {path}").strip() == first and time.monotonic() < deadline:
        time.sleep(3)
    metrics = ssh("lab1", f"cat {path}")
    assert ssh("lab1", f"stat -c %Y {path}").strip() != first
    assert 'gpufleet_health_check_ok{check="generate",unit="gpufleet-router.service"} 1' \
        in metrics


def test_a_checker_systemd_cannot_start_is_retried_then_named(lab):
    # exit 217 (USER) is systemd failing to set the process up, like the 219 (CGROUP) seen
    # once under a restart storm: the verify step runs the checker again, then names it
    dropin = "/etc/systemd/system/gpufleet-health.service.d"
    ssh("lab1", f"mkdir -p {dropin} && printf '[Service]\\nUser=no-such-user\\n' "
        f"> {dropin}/zz-test.conf && systemctl daemon-reload", check=True)
    try:
        proc = playbook("-i", "inventories/lab", "playbooks/plan.yml", "playbooks/health.yml",
                        "--limit", "localhost,lab1")
    finally:
        ssh("lab1", f"rm -rf {dropin} && systemctl daemon-reload", check=True)
    out = re.sub(r"\s+", " ", proc.stdout)
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert out.count("FAILED - RETRYING: [lab1]: Verify | Run the checker") == 2, out[-3000:]
    assert "gpufleet-health does not work on lab1" in out and "last run exit 217" in out
    assert playbook("-i", "inventories/lab", "playbooks/plan.yml",
                    "playbooks/health.yml").returncode == 0


def test_a_rebooted_host_comes_back_serving(lab):
    lab_hosts.reboot("lab1")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        state = units("h200-pd-1node")
        if state and all(u["ready"] for u in state.values()):
            break
        time.sleep(3)
    assert all(u["active"] == "active" and u["ready"] for u in state.values()), state
    assert fab("smoke", "--target", "h200-pd-1node").returncode == 0
    # the host's own boot units survived the deploy (stale-unit cleanup is ours only)
    assert ssh("lab1", "test -c /dev/nvidiactl && echo yes").strip() == "yes"


def test_sglang_pd_through_the_real_sglang_router(lab):
    proc = deployed("sglang-h200-pd")
    assert "tool_call       ok" in proc.stdout
    assert "sglang-router 0.3.2 does not route /v1/messages" in proc.stdout
    # the previous target's units are gone from lab1; prefill and decode are on two hosts
    state = units("sglang-h200-pd")
    assert {(u["unit"], u["active"]) for u in state.values()} == {
        ("gpufleet-prefill.service", "active"), ("gpufleet-decode.service", "active"),
        ("gpufleet-router.service", "active"), ("gpufleet-gateway.service", "active"),
        ("gpufleet-metrics.service", "active")}  # each host's metrics listener (the lab's)
    assert "gpufleet-decode.service" in ssh("lab2", "systemctl list-units 'gpufleet-*'")
    # the router forwards to the engines' /generate: SGLang counts those requests too
    metrics = ssh("lab1", "curl -sf http://127.0.0.1:9464/metrics/prefill", check=True)
    served = re.search(r"^sglang:num_requests_total\{[^}]*\} (\S+)$", metrics, re.M)
    assert served and float(served.group(1)) > 0, metrics[-2000:]


def test_dynamo_disaggregated_through_the_real_dynamo_frontend(lab):
    proc = deployed("h200-disagg")
    out = proc.stdout
    for check in ("ready", "reasoning", "tool_call", "json_schema", "image"):
        assert re.search(rf"- '?{check}\s+ok", out), check
    state = units("h200-disagg")
    assert {(u["unit"], u["active"]) for u in state.values()} == {
        ("gpufleet-etcd.service", "active"), ("gpufleet-prefill.service", "active"),
        ("gpufleet-decode.service", "active"), ("gpufleet-router.service", "active"),
        ("gpufleet-gateway.service", "active"), ("gpufleet-metrics.service", "active")}
    # etcd came from the OS package, whose own service stays off
    assert ssh("lab1", "systemctl is-active etcd.service || true").strip() == "inactive"
    # the real frontend's metrics, through the listener, after the smoke test's requests:
    # every dynamo_frontend_* family the dashboard and the alerts read, with series
    metrics = ssh("lab1", "curl -sf http://127.0.0.1:9464/metrics/router", check=True)
    for name in sorted(DYNAMO):
        assert re.search(rf"^{name}(_bucket)?\{{", metrics, re.M), (name, metrics[-3000:])
    # KV moves over RDMA here: the health checker's HCA metrics, which the dashboard's
    # InfiniBand row and the port alerts read, come through the listener too
    health = ssh("lab1", "curl -sf http://127.0.0.1:9464/metrics/health", check=True)
    for name in ("gpufleet_ib_port_up", "gpufleet_ib_port_rate_gbps", "gpufleet_ib_port_errors"):
        assert re.search(rf"^{name}\{{", health, re.M), (name, health[-3000:])


def test_fab_reads_what_the_plays_publish_not_their_task_names(lab, tmp_path):
    """fab status, health and acceptance read each host's published result (set_stats):
    the project copied with every play and task of their playbooks renamed answers alike."""
    copy = tmp_path / "renamed"
    # symlinks as links: collections/ links the checkout back as the collection (relative,
    # so the copy's link names the copy)
    shutil.copytree(ROOT, copy, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "__pycache__", "*.egg-info", ".ruff_cache"))
    for book in ("plan", "status", "health_report", "acceptance"):
        path = copy / "playbooks" / f"{book}.yml"
        text, renamed = re.subn(r"^(\s*- name: )([\"']?)", r"\1\2Renamed ", path.read_text(),
                                flags=re.M)
        assert renamed > 1, path
        path.write_text(text)

    def answers(root, *args):
        # the fab program of ROOT's checkout: its package first on the path
        proc = subprocess.run([sys.executable, "-c", "from gpufleet.tasks import main; main()",
                               *args, "--target", "h200-disagg", "--format", "json"],
                              cwd=root, env={**ENV, "PYTHONPATH": str(root)},
                              capture_output=True, text=True, timeout=600, check=False)
        return proc.returncode, json.loads(proc.stdout or "null")

    def seen(args, out):
        if args[0] == "status":
            return sorted((u["host"], u["unit"], u["active"], u["ready"]) for u in out["units"])
        return {h: (r.get("healthy", r.get("passed")), sorted(c.get("kind", c.get("name", ""))
                                                             for c in r["checks"]))
                for h, r in out["hosts"].items()}

    for args in (("status",), ("health",),
                 ("acceptance", "--while-serving", "--gpus", "0")):
        rc, original = answers(ROOT, *args)
        assert original and (original.get("units") or original.get("hosts")), (args, original)
        renamed_rc, renamed = answers(copy, *args)
        assert (renamed_rc, seen(args, renamed)) == (rc, seen(args, original)), args
    # the copy's playbooks are what ran: without their published result, fab status has
    # no units and names the hosts that reported nothing
    status = copy / "playbooks" / "status.yml"
    status.write_text(status.read_text().replace("gpufleet_report:", "something_else:"))
    rc, out = answers(copy, "status")
    assert (rc, out["units"], out["unreachable"]) == (1, [], ["lab1", "lab2"]), out


def test_acceptance_across_the_two_hosts_over_their_hcas(lab):
    """h200-disagg moves KV over RDMA: fab acceptance also runs the all_reduce across
    lab1 and lab2 (the lab's PyTorch stand-in times it at the HCAs' line rate) and checks
    every HCA port; one port trained down on lab2 is named there and slows both."""
    rate = "/etc/gpufleet-lab/sys/class/infiniband/mlx5_3/ports/1/rate"
    args = ("acceptance", "--target", "h200-disagg", "--while-serving", "--gpus", "0,1",
            "--format", "json")
    proc = fab(*args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    for host, report in json.loads(proc.stdout)["hosts"].items():
        kinds = [c["kind"] for c in report["checks"]]
        assert kinds.count("fabric") == 4 and kinds.count("hca") == 8, (host, kinds)
    before = ssh("lab2", f"cat {rate}", check=True)
    ssh("lab2", f"echo '100 Gb/sec (4X HDR)' > {rate}", check=True)
    try:
        proc = fab(*args)
    finally:
        ssh("lab2", f"echo '{before.strip()}' > {rate}", check=True)
    assert proc.returncode == 1
    hosts = json.loads(proc.stdout)["hosts"]
    for report in hosts.values():
        big = next(c for c in report["checks"] if c["kind"] == "fabric" and c["size_mib"] == 1024)
        assert big["verdict"] == "FAIL", big
    (named,) = [c["detail"] for c in hosts["lab2"]["checks"]
                if c["kind"] == "hca" and c["verdict"] == "FAIL"]
    assert named.startswith("mlx5_3 port 1 at 100 Gb/s, the others at 400")


def test_teardown_leaves_the_hosts_clean(lab):
    proc = fab("teardown", "--target", "h200-disagg")
    assert proc.returncode == 0, proc.stdout[-3000:]
    for host in ("lab1", "lab2"):
        left = ssh(host, "ls /etc/systemd/system | grep gpufleet | grep -v gpufleet-lab; "
                         "ls -d /etc/gpufleet /var/lib/gpufleet /opt/gpufleet 2>/dev/null; "
                         "systemctl list-units --all --no-legend 'gpufleet-*' | grep -v lab-hw")
        assert left.strip() == "", f"{host}: {left}"
        # what is not gpufleet's stays: the lab's own hardware unit
        assert ssh(host, "systemctl is-enabled gpufleet-lab-hw.service").strip() == "enabled"
    assert ssh("lab1", "ls /var/cache/gpufleet/hf/hub").strip(), "the cache is kept"
