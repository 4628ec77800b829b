"""A real Prometheus scrapes a deployed lab target through the hosts' metrics listeners.

Debian's Prometheus server (the prometheus package scripts/setup installs for promtool)
runs on the controller, an address gpufleet_metrics_allow lists in the lab inventory, with
what `fab monitoring --write` gives it: the file_sd targets, the deployment's alert bounds
and monitoring/gpufleet-alerts.yml as it ships. After traffic through the gateway (and one
request without the key) no serving alert is pending; a fatal Xid fires GpufleetGpuFatalXid
(dcgm-exporter, the lab's, sees it too) and it resolves once cleared; every query of every
dashboard panel returned a series, healthy or while the fault lasted, and so did every
metric an alert reads. With --slow: a hung engine (SIGSTOP: its metrics stop answering)
fires GpufleetScrapeTargetDown after its 2 minutes, which resolves once it runs again.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from labutil import ROOT, api_client, fab, http_status, ssh, tls

from gpufleet_lab import hosts as lab_hosts

sys.path.insert(0, str(ROOT / "tests" / "unit"))
from test_monitoring import promql_metrics  # noqa: E402 - the unit suite's PromQL reader

pytestmark = pytest.mark.lab

TARGET = "h200-pd-1node"
PORT = 19090  # off the lab's ports; Prometheus on loopback of the controller
SCRAPE_S = 2
MONITORING = ROOT / "monitoring"
# The deployed target is vLLM's: the panels' and alerts' SGLang and Dynamo alternatives
# (`A or B or C`) and node_exporter's (the listener serves the checker's file) are the
# other engines' and the other way's; the unit suite checks their names against the
# stand-ins and the docs.
OTHER_WAYS = ("sglang:", "dynamo_", "node_exporter_")
# What shows on other hosts than this target's: the checker reads the HCAs of a target
# that moves data over RDMA (test_deploy's h200-disagg reads these off its listener), and
# XGMI on AMD hosts (tests/unit/test_healthcheck.py, from amd-smi's output).
ELSEWHERE = {
    "gpufleet_ib_port_up": "InfiniBand", "gpufleet_ib_port_rate_gbps": "InfiniBand",
    "gpufleet_ib_port_errors": "InfiniBand", "gpufleet_gpu_xgmi_links": "AMD XGMI",
}


def wait(check, timeout: float, interval: float = 1.0):
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(interval)


class Prometheus:
    def __init__(self, folder: Path):
        self.folder = folder
        self.url = f"http://127.0.0.1:{PORT}"
        self.proc: subprocess.Popen | None = None

    def start(self, targets: Path) -> None:
        config = self.folder / "prometheus.yml"
        config.write_text(
            f"global:\n  scrape_interval: {SCRAPE_S}s\n  scrape_timeout: {SCRAPE_S}s\n"
            f"  evaluation_interval: {SCRAPE_S}s\n"
            f"rule_files:\n  - {targets}/gpufleet-alerts.yml\n  - {targets}/*.rules.yml\n"
            f"scrape_configs:\n  - job_name: gpufleet\n    file_sd_configs:\n"
            f"      - files: ['{targets}/*.json']\n")
        check = subprocess.run(["promtool", "check", "config", str(config)],
                               capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        self.log = (self.folder / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={config}",
             f"--storage.tsdb.path={self.folder / 'data'}",
             f"--web.listen-address=127.0.0.1:{PORT}"],
            stdout=self.log, stderr=subprocess.STDOUT)
        ready = wait(lambda: self._ready(), 60, 0.5)
        assert ready, (self.folder / "prometheus.log").read_text()[-3000:]

    def _ready(self) -> bool:
        assert self.proc.poll() is None, (self.folder / "prometheus.log").read_text()[-3000:]
        try:
            return http_status(f"{self.url}/-/ready", timeout=2) == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc:
            self.proc.terminate()
            self.proc.wait(30)
            self.log.close()

    def api(self, path: str, **params) -> dict:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=30) as resp:
            body = json.load(resp)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self.api("query", query=expr)["result"]


@pytest.fixture(scope="module")
def deployed(lab):
    proc = fab("deploy", "--target", TARGET)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    return json.loads(fab("endpoint", "--format", "json").stdout)


@pytest.fixture(scope="module")
def prometheus(deployed, tmp_path_factory):
    folder = tmp_path_factory.mktemp("prometheus")
    targets = folder / "gpufleet"
    out = fab("monitoring", "--write", str(targets))
    assert out.returncode == 0, out.stderr
    # the rules as they ship, beside the deployment's targets and bounds
    assert (targets / "gpufleet-alerts.yml").read_text() == \
        (MONITORING / "gpufleet-alerts.yml").read_text()
    prom = Prometheus(folder)
    prom.start(targets)
    try:
        # every target scraped once at least
        groups = json.loads((targets / "lab.json").read_text())
        assert wait(lambda: len(prom.query('up{job="gpufleet"} == 1')) == len(groups), 60), \
            prom.api("targets")
        yield prom
    finally:
        prom.stop()


@pytest.fixture(scope="module")
def traffic(deployed, prometheus):
    """Requests through the gateway (and one refused without the key), then the health
    checker's run on each host, which counts the gateway's responses from its log."""
    client = api_client(deployed, deployed["api_key"], timeout=60)
    for i in range(6):
        reply = client.chat.completions.create(
            model=deployed["model"], max_tokens=16,
            messages=[{"role": "user", "content": f"count to {i + 3}"}])
        assert reply.choices[0].finish_reason in ("stop", "length"), reply
    stream = client.chat.completions.create(
        model=deployed["model"], max_tokens=16, stream=True,
        messages=[{"role": "user", "content": "say hello"}])
    assert any(chunk.choices for chunk in stream)
    assert http_status(f"{deployed['endpoint']}/models", context=tls(deployed)) == 401
    hosts = {g["labels"]["host"] for g in json.loads(
        fab("monitoring", "--format", "json").stdout)}
    for host in sorted(hosts):
        ssh(host, "systemctl start gpufleet-health.service")
    seen = wait(lambda: prometheus.query(
        'gpufleet_gateway_responses_total{code="401"} > 0'), 30)
    assert seen, "the gateway's 401 is not counted in Prometheus"
    # the engines' counters moved within the last scrapes: the rates below are not empty
    assert wait(lambda: prometheus.query("rate(vllm:request_success_total[1m]) > 0"), 20)
    return hosts


def dashboard_queries() -> list[tuple[str, str]]:
    dash = json.loads((MONITORING / "gpufleet-dashboard.json").read_text())
    out = []
    for panel in dash["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            for target in inner.get("targets", []):
                expr = (target["expr"].replace("$__rate_interval", "1m")
                        .replace("$deployment", ".*").replace("$instance", ".*"))
                out.append((inner["title"], expr))
    return out


def alert_rules() -> list[dict]:
    rules = yaml.safe_load((MONITORING / "gpufleet-alerts.yml").read_text())
    return [r for g in rules["groups"] for r in g["rules"] if "alert" in r]


def alert_metrics() -> dict[str, list[str]]:
    """{alert: the metrics its expression reads} (this target's way of serving them)."""
    return {r["alert"]: sorted(n for n in promql_metrics(r["expr"])
                               if not n.startswith(OTHER_WAYS) and n not in ELSEWHERE)
            for r in alert_rules()}


def shown(prometheus) -> tuple[set[str], set[str]]:
    """The dashboard queries and the alerts' metrics that have series now."""
    queries = {expr for _, expr in dashboard_queries() if prometheus.query(expr)}
    names = {n for names in alert_metrics().values() for n in names
             if prometheus.query(f'count({{__name__="{n}", deployment="lab"}})')}
    return queries, names


def firing(prometheus, name: str) -> list[dict]:
    return [a for a in prometheus.api("alerts")["alerts"]
            if a["labels"]["alertname"] == name and a["state"] == "firing"]


# the serving alerts and the one that says a host's checker metrics are missing
SERVING = ("GpufleetScrapeTargetDown", "GpufleetAlertBoundsMissing",
           "GpufleetTimeToFirstTokenHigh", "GpufleetInterTokenLatencyHigh",
           "GpufleetRequestsQueueing", "GpufleetKvCacheFull", "GpufleetGatewayErrors",
           "GpufleetEngineRequestErrors", "GpufleetHealthCheckerAbsent")


def test_no_serving_alert_is_pending_on_the_healthy_deployment(prometheus, traffic):
    time.sleep(3 * SCRAPE_S)  # a few evaluations of the rules
    for alert in prometheus.query("ALERTS"):
        assert alert["metric"]["alertname"] not in SERVING, alert["metric"]
    bounds = prometheus.query('gpufleet_alert_bound{deployment="lab"}')
    assert {b["metric"]["bound"] for b in bounds} == {
        "ttft_p99_seconds", "itl_p99_seconds", "requests_waiting", "kv_cache_usage",
        "gateway_5xx_ratio", "engine_error_ratio"}


def hold(host: str) -> None:
    """The deploy lock, as a deploy holds it: the health checker neither restarts nor
    drains anything on HOST while a test makes it sick."""
    lock = json.dumps({"holder": "test_monitoring_lab", "expires": time.time() + 600})
    ssh(host, f"mkdir -p /run/gpufleet && echo '{lock}' > /run/gpufleet/deploy.lock",
        check=True)


@pytest.fixture(scope="module")
def faults(prometheus, traffic):
    """A fatal Xid 79 on lab1's GPU 0 in the kernel log, under the deploy lock: what the
    dashboard and the alerts show while it lasts, the alert that fired; then it is undone
    as after the GPU's reset (the Xid cleared) and the alert resolves."""
    host = "lab1"
    pci = re.search(r'<gpu id="0000(\w{4}:\w\w:\w\w)\.0">',
                    ssh(host, "nvidia-smi -q -x")).group(1)
    hold(host)
    started = time.monotonic()
    try:
        lab_hosts.kernel_message(host, f"NVRM: Xid (PCI:{pci}): 79, pid=0, GPU has fallen "
                                       "off the bus.")
        ssh(host, "systemctl start gpufleet-health.service")
        fired = wait(lambda: firing(prometheus, "GpufleetGpuFatalXid"), 60, 1)
        print(f"GpufleetGpuFatalXid firing after {time.monotonic() - started:.0f}s")
        during = shown(prometheus)
        dcgm = prometheus.query('DCGM_FI_DEV_XID_ERRORS{instance="lab1"} == 79')
    finally:
        lab_hosts.clear_kernel_messages(host)
        ssh(host, "/usr/bin/python3 -I -B /usr/local/lib/gpufleet/healthcheck.py --clear-xid "
                  "all; systemctl start gpufleet-health.service; rm -f /run/gpufleet/deploy.lock",
            check=True)
    resolved = wait(lambda: not firing(prometheus, "GpufleetGpuFatalXid"), 60, 2)
    return {"fired": fired, "during": during, "dcgm": dcgm, "pci": pci, "resolved": resolved}


def test_a_fatal_xid_fires_its_alert_and_resolves(faults):
    (xid,) = faults["fired"]
    assert (xid["labels"]["instance"], xid["labels"]["xid"], xid["labels"]["severity"]) == \
        ("lab1", "79", "critical")
    assert faults["pci"] in xid["labels"]["pci"], xid["labels"]
    assert xid["annotations"]["runbook_url"] == "docs/monitoring.md#gpufleetgpufatalxid"
    # the site's dcgm-exporter saw the same Xid on that GPU (its last Xid)
    assert [s["metric"]["pci_bus_id"].lower() for s in faults["dcgm"]] == [
        f"0000{faults['pci']}.0".lower()], faults["dcgm"]
    assert faults["resolved"], "the alert did not resolve once the Xid was cleared"


@pytest.mark.slow  # GpufleetScrapeTargetDown's 2 minutes; the rules' unit tests cover it too
def test_a_hung_engine_fires_scrape_target_down_and_it_resolves(prometheus, traffic):
    """The decode engine hung (SIGSTOP: its unit stays active, its metrics stop answering),
    under the deploy lock: GpufleetScrapeTargetDown fires after its 2 minutes and resolves
    once the engine runs again (SIGCONT)."""
    hold("lab1")
    try:
        ssh("lab1", "systemctl kill --signal=SIGSTOP gpufleet-decode.service", check=True)
        fired = wait(lambda: firing(prometheus, "GpufleetScrapeTargetDown"), 180, 2)
    finally:
        ssh("lab1", "systemctl kill --signal=SIGCONT gpufleet-decode.service; "
                    "rm -f /run/gpufleet/deploy.lock", check=True)
    (down,) = fired
    assert {k: down["labels"][k] for k in ("deployment", "process", "role", "severity",
                                           "instance")} == {
        "deployment": "lab", "process": "decode", "role": "decode", "severity": "critical",
        "instance": "lab1"}
    assert down["annotations"]["runbook_url"] == "docs/monitoring.md#gpufleetscrapetargetdown"
    assert wait(lambda: not firing(prometheus, "GpufleetScrapeTargetDown"), 30, 2)


def test_every_dashboard_query_returns_a_series(prometheus, faults):
    """Healthy (after the faults: the Xid counts stay) or while the faults lasted (the
    failing checks, the unresolved fatal Xid)."""
    now, _ = shown(prometheus)
    empty = [f"{title}: {expr}" for title, expr in dashboard_queries()
             if expr not in now | faults["during"][0]
             and not all(n in ELSEWHERE for n in promql_metrics(expr))]
    assert not empty, "panels without data:\n" + "\n".join(empty)


def test_every_metric_an_alert_reads_has_series(prometheus, faults):
    for rule in alert_rules():
        prometheus.query(rule["expr"])  # the expression itself evaluates
    _, now = shown(prometheus)
    missing = {alert: [n for n in names if n not in now | faults["during"][1]]
               for alert, names in alert_metrics().items()}
    missing = {alert: names for alert, names in missing.items() if names}
    assert not missing, f"alerts reading metrics without series: {missing}"
