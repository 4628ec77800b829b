"""What the plan says of the deployment's metrics (`monitoring`), and `fab monitoring`.

Every process that serves Prometheus metrics has the URL its own host reads them at
(a router's on loopback at its own port, SGLang's with --enable-metrics, a Dynamo worker's
system server, etcd's client port); gpufleet_metrics_allow turns on each host's listener,
whose port is refused where a process of the plan has it; the scrape targets carry the
deployment's labels and the path the listener serves each process at.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_plan_workers import hosts  # inventories of N hosts a group, 10.9.G.N

from gpufleet import monitoring
from gpufleet.host import healthcheck
from gpufleet.model import PlanError
from gpufleet.plan import make_plan

REPO = Path(__file__).resolve().parents[2]
ALLOW = {"metrics_allow": ["10.0.0.5", "10.8.0.0/16"]}
ALERTS = REPO / "monitoring" / "gpufleet-alerts.yml"


def upstreams(plan) -> dict[str, str]:
    """The processes' metrics URLs (the health checker's file is no process's)."""
    return {t["process"]: t["upstream"] for t in plan.monitoring["targets"] if t["upstream"]}


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_vllm_pd_engines_and_the_router_on_loopback():
    plan = make_plan("h200-pd-1node", hosts(workers=1), ALLOW)
    assert upstreams(plan) == {"prefill": "http://127.0.0.1:8001/metrics",
                               "decode": "http://127.0.0.1:8002/metrics",
                               "router": "http://127.0.0.1:29000/metrics"}
    (router,) = plan.by_role("router")
    # sglang-router binds its metrics on every address unless told: the plan says loopback
    assert (flag(router.argv, "--prometheus-host"), flag(router.argv, "--prometheus-port")) == \
        ("127.0.0.1", "29000")
    assert {"process": "router", "host": "workers-1", "address": "10.9.0.1", "name": "metrics",
            "port": 29000} in plan.exposure["loopback"]
    assert plan.monitoring["listener"] == {"port": 9464, "allow": ["10.0.0.5", "10.8.0.0/16"]}
    assert plan.monitoring["conf_dir"] == "/etc/gpufleet/metrics"
    assert 9464 in plan.hosts["workers-1"].ports  # preflight checks nothing else holds it
    assert all(t["path"] == f"/metrics/{t['process']}" for t in plan.monitoring["targets"])


def test_sglang_pd_engines_and_the_router():
    plan = make_plan("sglang-h200-pd", hosts(prefill=1, decode=1), ALLOW)
    assert upstreams(plan) == {"prefill": "http://10.9.0.1:30000/metrics",
                               "decode": "http://10.9.1.1:30000/metrics",
                               "router": "http://127.0.0.1:29000/metrics"}
    assert all("--enable-metrics" in p.argv for p in plan.engines)


def test_dynamo_workers_system_servers_the_frontend_and_etcd():
    plan = make_plan("h200-disagg", hosts(prefill=1, decode=1), ALLOW)
    assert upstreams(plan) == {"etcd": "http://10.9.0.1:2379/metrics",
                               "prefill": "http://10.9.0.1:9090/metrics",
                               "decode": "http://10.9.1.1:9090/metrics",
                               "router": "http://127.0.0.1:8000/metrics"}
    assert not any(p.role == "gateway" and p.metrics for p in plan.processes)


def test_a_multi_node_engines_other_ranks_serve_no_metrics():
    plan = make_plan("sglang-h200-balanced-bf16", hosts(workers=2), ALLOW)
    assert upstreams(plan) == {"worker-0": "http://127.0.0.1:30000/metrics"}


def test_each_router_of_a_pool_has_its_own_metrics_port():
    plan = make_plan("h200-pd-1node", hosts(workers=2),
                     {**ALLOW, "workers": {"prefill": 2, "decode": 1}})
    routers = plan.by_role("router")
    assert len(routers) == 2
    ports = [flag(r.argv, "--prometheus-port") for r in routers]
    assert ports == ["29000", "29100"], ports
    assert [upstreams(plan)[r.name] for r in routers] == [
        "http://127.0.0.1:29000/metrics", "http://127.0.0.1:29100/metrics"]


def test_each_host_runs_a_listener_where_an_allow_list_is_set():
    plan = make_plan("sglang-h200-pd", hosts(prefill=1, decode=1), ALLOW)
    listeners = plan.by_role("metrics")
    assert [(m.host, m.bind, m.ports, m.unit) for m in listeners] == [
        ("prefill-1", "10.9.0.1", {"http": 9464}, "gpufleet-metrics.service"),
        ("decode-1", "10.9.1.1", {"http": 9464}, "gpufleet-metrics.service")]
    assert listeners[0].argv == ["/usr/sbin/nginx", "-e", "stderr", "-c",
                                 "/etc/gpufleet/metrics/nginx.conf"]
    # the host's own probe, on loopback; fab restart leaves it; it has no metrics itself
    assert listeners[0].readiness.url == "http://127.0.0.1:9464/health"
    assert not listeners[0].rolled and listeners[0].metrics is None
    assert [e["host"] for e in plan.exposure["monitoring"]] == ["prefill-1", "decode-1"]
    assert "nginx" in plan.hosts["decode-1"].system_packages
    assert "gpufleet-metrics.service" in plan.hosts["decode-1"].units


def test_replicas_one_listener_per_host():
    plan = make_plan("h200-agg", hosts(workers=2), {**ALLOW, "replicas": True})
    assert sorted(m.host for m in plan.by_role("metrics")) == ["workers-1", "workers-2"]


def test_without_an_allow_list_no_listener():
    plan = make_plan("h200-pd-1node", hosts(workers=1))
    assert not plan.by_role("metrics") and not plan.exposure["monitoring"]
    assert plan.monitoring["listener"] is None and 9464 not in plan.hosts["workers-1"].ports
    assert plan.monitoring["targets"]  # what the processes serve is planned all the same


@pytest.mark.parametrize(("overrides", "field", "says"), [
    ({"metrics_port": 8001}, "gpufleet_metrics_port", "8001 is the prefill's port on workers-1"),
    ({"metrics_port": 29000}, "gpufleet_metrics_port", "the router's port"),
])
def test_the_listeners_port_is_refused_where_a_process_has_it(overrides, field, says):
    with pytest.raises(PlanError) as err:
        make_plan("h200-pd-1node", hosts(workers=1), {**ALLOW, **overrides})
    assert field in str(err.value) and says in str(err.value), str(err.value)


@pytest.mark.parametrize(("value", "says"), [
    ("10.0.0.5", "is not a list"),
    (["10.0.0.5/8"], "host bits zero"),
    (["prometheus.example"], "is not an address or a network"),
    (["10.0.0.5\nallow all"], "control character"),
])
def test_a_bad_allow_list_is_refused_with_the_fix(value, says):
    with pytest.raises(PlanError) as err:
        make_plan("h200-pd-1node", hosts(workers=1), {"metrics_allow": value})
    assert "gpufleet_metrics_allow" in str(err.value) and says in str(err.value)
    assert "Fix:" in str(err.value)


def test_file_sd_labels_each_process_with_its_deployment():
    plan = make_plan("sglang-h200-pd", hosts(prefill=1, decode=1), ALLOW)
    groups = monitoring.file_sd(plan.monitoring)
    assert {"targets": ["10.9.0.1:9464"],
            "labels": {"__metrics_path__": "/metrics/router", "deployment": "test",
                       "target": "sglang-h200-pd", "host": "prefill-1",
                       "instance": "prefill-1", "role": "router", "process": "router"}} in groups
    assert {"targets": ["10.9.1.1:9464"],
            "labels": {"__metrics_path__": "/metrics/health", "deployment": "test",
                       "target": "sglang-h200-pd", "host": "decode-1",
                       "instance": "decode-1", "role": "health", "process": "health"}} in groups
    assert len(groups) == 5  # prefill, decode, router; each host's health checker


def test_each_host_serves_its_health_checkers_file():
    plan = make_plan("sglang-h200-pd", hosts(prefill=1, decode=1), ALLOW)
    health = [t for t in plan.monitoring["targets"] if t["process"] == "health"]
    assert [(t["host"], t["file"], t["upstream"]) for t in health] == [
        ("prefill-1", "/var/lib/prometheus/node-exporter/gpufleet.prom", None),
        ("decode-1", "/var/lib/prometheus/node-exporter/gpufleet.prom", None)]
    # the one path: the health role's default and the checker's agree with the plan
    defaults = yaml.safe_load((REPO / "roles/health/defaults/main.yml").read_text())
    assert defaults["health_textfile"] == health[0]["file"]
    assert health[0]["file"] == healthcheck.DEFAULT_TEXTFILE


def test_alert_bounds_default_and_from_the_inventory():
    plan = make_plan("h200-pd-1node", hosts(workers=1), ALLOW)
    assert plan.monitoring["bounds"] == {
        "ttft_p99_seconds": 10.0, "itl_p99_seconds": 0.5, "requests_waiting": 32,
        "kv_cache_usage": 0.95, "gateway_5xx_ratio": 0.05, "engine_error_ratio": 0.05}
    plan = make_plan("h200-pd-1node", hosts(workers=1),
                     {**ALLOW, "alert_bounds": {"ttft_p99_seconds": 2.5}})
    assert plan.monitoring["bounds"]["ttft_p99_seconds"] == 2.5


@pytest.mark.parametrize(("bounds", "says"), [
    ({"ttft_p99_seconds": 0}, "gpufleet_alert_bounds.ttft_p99_seconds: Input should be "
                              "greater than 0"),
    ({"kv_cache_usage": 1.5}, "gpufleet_alert_bounds.kv_cache_usage: Input should be less"),
    ({"ttft": 3}, "gpufleet_alert_bounds.ttft: Extra inputs are not permitted"),
])
def test_a_bad_alert_bound_is_refused_with_the_fix(bounds, says):
    with pytest.raises(PlanError) as err:
        make_plan("h200-pd-1node", hosts(workers=1), {**ALLOW, "alert_bounds": bounds})
    assert says in str(err.value) and "Fix: give the bounds docs/monitoring.md lists" in \
        str(err.value)


def test_the_bounds_rules_are_what_promtool_accepts(tmp_path):
    plan = make_plan("h200-pd-1node", hosts(workers=1),
                     {**ALLOW, "alert_bounds": {"kv_cache_usage": 0.9}})
    _, rules, _ = monitoring.write(plan.monitoring, str(tmp_path), str(ALERTS))
    data = yaml.safe_load(Path(rules).read_text())
    (group,) = data["groups"]
    assert {"record": "gpufleet_alert_bound", "expr": "vector(0.9)",
            "labels": {"deployment": "test", "bound": "kv_cache_usage"}} in group["rules"]
    assert len(group["rules"]) == 6
    exe = shutil.which("promtool")
    assert exe, "promtool not found. Fix: apt-get install prometheus (scripts/setup installs it)"
    out = subprocess.run([exe, "check", "rules", rules], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_targets_file_is_written_whole(tmp_path):
    plan = make_plan("h200-pd-1node", hosts(workers=1), ALLOW)
    written = monitoring.write(plan.monitoring, str(tmp_path / "sd"), str(ALERTS))
    assert written == [str(tmp_path / "sd" / name)
                       for name in ("test.json", "test.rules.yml", "gpufleet-alerts.yml")]
    assert json.loads(Path(written[0]).read_text()) == monitoring.file_sd(plan.monitoring)
    assert Path(written[2]).read_text() == ALERTS.read_text()
    assert {stat.S_IMODE(os.stat(p).st_mode) for p in written} == {0o644}
    # no temporary file left
    assert sorted(os.listdir(tmp_path / "sd")) == sorted(os.path.basename(p) for p in written)


def fab(tmp_path, *args):
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "config")}
    return subprocess.run([sys.executable, "-m", "gpufleet", "monitoring", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)


def inventory(tmp_path, allow):
    inv = tmp_path / "eu1"
    (inv / "group_vars").mkdir(parents=True)
    (inv / "hosts.yml").write_text(
        "all:\n  children:\n    workers:\n      hosts:\n"
        "        gpu1: {ansible_host: 10.9.0.1}\n")
    (inv / "group_vars" / "all.yml").write_text(
        "gpufleet_target: h200-pd-1node\n"
        + (f"gpufleet_metrics_allow: {json.dumps(allow)}\n" if allow else ""))
    return str(inv)


def test_fab_monitoring_writes_the_targets_and_prints_the_job(tmp_path):
    inv = inventory(tmp_path, ["10.0.0.5"])
    out = fab(tmp_path, "-i", inv, "--write", str(tmp_path / "sd"))
    assert out.returncode == 0, out.stderr
    assert "  - job_name: gpufleet\n    file_sd_configs:\n" in out.stdout
    assert f"files: ['{tmp_path}/sd/*.json']" in out.stdout
    assert "open to 10.0.0.5" in out.stdout
    assert f"rule_files:\n  - {tmp_path}/sd/gpufleet-alerts.yml\n  - {tmp_path}/sd/*.rules.yml\n" \
        in out.stdout
    assert (tmp_path / "sd" / "gpufleet-alerts.yml").read_text() == ALERTS.read_text()
    written = json.loads((tmp_path / "sd" / "eu1.json").read_text())
    assert {g["labels"]["process"] for g in written} == {"prefill", "decode", "router", "health"}
    assert (tmp_path / "sd" / "eu1.rules.yml").is_file()
    assert all(g["targets"] == ["10.9.0.1:9464"] for g in written)
    as_json = fab(tmp_path, "-i", inv, "--format", "json")
    assert as_json.returncode == 0 and json.loads(as_json.stdout) == written


def test_fab_monitoring_without_an_allow_list_says_what_to_set(tmp_path):
    out = fab(tmp_path, "-i", inventory(tmp_path, None))
    assert out.returncode == 2 and not out.stdout
    assert "gpufleet_metrics_allow is empty" in out.stderr and "Fix:" in out.stderr
