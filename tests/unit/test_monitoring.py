"""The Prometheus alert rules and the Grafana dashboard in monitoring/.

promtool (Debian's prometheus package) checks the rules and runs their unit tests; the
rest checks that every alert is tested, annotated and has its runbook, that the dashboard
is well formed, and that every metric the rules and the dashboard use is one that exists:
the health checker's (its source), the engines' (the lab's stand-ins emit the names the
real engines define, lab/standins/gpufleet_standin/metrics.json, which says where each was
read), dcgm-exporter's (the lab's stand-in), Dynamo's frontend's (the lab runs the real
one), and the bounds `fab monitoring` writes; docs/monitoring.md lists each with its source.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
MONITORING = REPO / "monitoring"
RULES = MONITORING / "gpufleet-alerts.yml"
RULES_TEST = MONITORING / "gpufleet-alerts_test.yml"
DASHBOARD = MONITORING / "gpufleet-dashboard.json"
CHECKER = REPO / "gpufleet" / "host" / "healthcheck.py"
DOC = REPO / "docs" / "monitoring.md"
STANDIN_METRICS = REPO / "lab" / "standins" / "gpufleet_standin" / "metrics.json"
DCGM_STANDIN = REPO / "lab" / "gpufleet_lab" / "hwsim_data" / "hwlab.py"

# What the health checker writes (roles/health/README.md lists them with their labels).
METRICS = {
    "gpufleet_health_check_ok",
    "gpufleet_health_check_status",
    "gpufleet_health_check_duration_seconds",
    "gpufleet_health_ok",
    "gpufleet_health_last_run_timestamp_seconds",
    "gpufleet_health_run_duration_seconds",
    "gpufleet_unit_consecutive_failures",
    "gpufleet_unit_in_startup_window",
    "gpufleet_unit_restarts_total",
    "gpufleet_generation_latency_seconds",
    "gpufleet_cache_free_bytes",
    "gpufleet_gpu_info",
    "gpufleet_gpu_ecc_uncorrected_errors",
    "gpufleet_gpu_remapped_rows",
    "gpufleet_gpu_remap_pending",
    "gpufleet_gpu_remap_failed",
    "gpufleet_gpu_pcie_link_gen",
    "gpufleet_gpu_pcie_link_width",
    "gpufleet_gpu_clock_event_active",
    "gpufleet_gpu_temperature_celsius",
    "gpufleet_gpu_fabric_ok",
    "gpufleet_gpu_nvlink_links",
    "gpufleet_gpu_nvlink_errors",
    "gpufleet_gpu_ras_errors",
    "gpufleet_gpu_xgmi_links",
    "gpufleet_gpu_xid_events_total",
    "gpufleet_gpu_xid_fatal",
    "gpufleet_ib_port_up",
    "gpufleet_ib_port_rate_gbps",
    "gpufleet_ib_port_errors",
    "gpufleet_host_fault",
    "gpufleet_unit_drained",
    "gpufleet_gateway_responses_total",
    "gpufleet_gateway_log_unparsed_total",
}
# Not the checker's: Prometheus' own `up`, node_exporter's build info (the absent alert
# tells node_exporter targets from other scrape targets with it), and the deployments'
# alert bounds (gpufleet/monitoring.py bound_rules).
STANDARD = {"up", "node_exporter_build_info", "gpufleet_alert_bound"}
# Dynamo 1.6.1's frontend (the lab runs the real one; test_deploy reads them off it)
DYNAMO = {
    "dynamo_frontend_inflight_requests",
    "dynamo_frontend_queued_requests",
    "dynamo_frontend_time_to_first_token_seconds",
    "dynamo_frontend_inter_token_latency_seconds",
    "dynamo_frontend_request_duration_seconds",
}

# PromQL words that are not metric names: operators, modifiers, aggregations (which may
# be followed by `by (...)` rather than `(`), and functions (also caught by the `(`).
KEYWORDS = {
    "and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
    "group_left", "group_right", "inf", "nan",
    "sum", "min", "max", "avg", "count", "group", "stddev", "stdvar", "topk", "bottomk",
    "quantile", "count_values",
    "rate", "irate", "increase", "delta", "idelta", "deriv", "absent", "absent_over_time",
    "max_over_time", "min_over_time", "avg_over_time", "sum_over_time", "count_over_time",
    "last_over_time", "changes", "resets", "time", "timestamp", "vector", "scalar",
    "clamp_min", "clamp_max", "label_replace", "label_join", "sort", "sort_desc",
    "histogram_quantile", "abs", "ceil", "floor", "round",
}
LABEL_LIST = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
IDENT = re.compile(r"(?<![\w.])([a-zA-Z_:][\w:]*)(?![\w:])(?!\s*\()")


def promql_metrics(expr):
    """Metric names in a PromQL expression: what is left after dropping strings, label
    matchers, ranges, Grafana variables, label lists, keywords and function calls."""
    text = re.sub(r"\$\{?\w+\}?", " ", expr)  # Grafana: $instance, ${datasource}, $__rate_interval
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', text)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = LABEL_LIST.sub(" ", text)
    return {name for name in IDENT.findall(text) if name.lower() not in KEYWORDS}


def test_promql_metrics_tokenizer():
    assert promql_metrics(
        "sum by (instance, unit) "
        '(increase(gpufleet_unit_restarts_total{instance=~"$instance"}[1h])) >= 3'
    ) == {"gpufleet_unit_restarts_total"}
    assert promql_metrics(
        "up == 1 and on(instance, job) node_exporter_build_info\n"
        "unless on(instance) gpufleet_health_last_run_timestamp_seconds"
    ) == {"up", "node_exporter_build_info", "gpufleet_health_last_run_timestamp_seconds"}
    expr = "time() - gpufleet_health_ok > 1e3 or vector(0)"
    assert promql_metrics(expr) == {"gpufleet_health_ok"}


def load_rules():
    return yaml.safe_load(RULES.read_text())


def alerts():
    return [rule for group in load_rules()["groups"] for rule in group["rules"] if "alert" in rule]


def load_dashboard():
    return json.loads(DASHBOARD.read_text())


def dashboard_panels():
    for panel in load_dashboard()["panels"]:
        yield panel
        yield from panel.get("panels", [])  # collapsed rows carry their panels


def promtool(*args):
    exe = shutil.which("promtool")
    if exe is None:
        pytest.fail(
            "promtool not found. Fix: apt-get install prometheus (scripts/setup installs it)"
        )
    proc = subprocess.run([exe, *args], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (
        f"promtool {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}{proc.stderr}"
    )
    return proc.stdout


def test_promtool_check_rules():
    promtool("check", "rules", str(RULES.relative_to(REPO)))


def test_promtool_test_rules():
    promtool("test", "rules", str(RULES_TEST.relative_to(REPO)))


def test_every_alert_has_severity_summary_description_and_runbook():
    names = [rule["alert"] for rule in alerts()]
    assert names and len(names) == len(set(names)), f"duplicate alert names: {names}"
    headings = set(re.findall(r"^### (Gpufleet\w+)$", DOC.read_text(), re.MULTILINE))
    for rule in alerts():
        where = rule["alert"]
        assert rule.get("labels", {}).get("severity") in ("critical", "warning"), where
        for key in ("summary", "description"):
            text = rule.get("annotations", {}).get(key, "")
            assert "{{ $labels.instance }}" in text or "{{ $labels.deployment }}" in text, \
                f"{where}: {key} names neither the host nor the deployment"
        # the runbook: a section of docs/monitoring.md (GitHub's and Grafana's anchors)
        assert rule["annotations"].get("runbook_url") == \
            f"docs/monitoring.md#{where.lower()}", where
        assert where in headings, f"{where}: no '### {where}' runbook in docs/monitoring.md"


def test_every_alert_fires_in_some_test():
    tests = yaml.safe_load(RULES_TEST.read_text())
    assert tests["rule_files"] == [RULES.name]
    firing, quiet = set(), set()
    for group in tests["tests"]:
        for case in group.get("alert_rule_test", []):
            (firing if case.get("exp_alerts") else quiet).add(case["alertname"])
    names = {rule["alert"] for rule in alerts()}
    assert names - firing == set(), "alerts with no firing case"
    assert names - quiet == set(), "alerts with no case where they stay quiet"
    assert (firing | quiet) - names == set(), "tests of alerts that do not exist"


def test_dashboard_structure():
    dash = load_dashboard()
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    instance = variables["instance"]
    assert instance["type"] == "query"
    assert 'label_values(gpufleet_health_ok{deployment=~\\"$deployment\\"}, instance)' in \
        json.dumps(instance["query"])
    assert instance["datasource"]["uid"] == "${datasource}"
    deployment = variables["deployment"]
    # every deployment, and series without the label (a node_exporter scraped on its own)
    assert deployment["includeAll"] and deployment["allValue"] == ".*"
    assert list(variables) == ["datasource", "deployment", "instance"]
    ids = [panel["id"] for panel in dashboard_panels()]
    assert len(ids) == len(set(ids)), "panel ids are not unique"
    rows = [panel["title"] for panel in dashboard_panels() if panel["type"] == "row"]
    assert len(rows) >= 4, rows
    for panel in dashboard_panels():
        where = f"panel {panel['id']} {panel.get('title')!r}"
        pos = panel["gridPos"]
        assert all(isinstance(pos[k], int) for k in ("x", "y", "w", "h")), where
        assert pos["x"] >= 0 and pos["w"] > 0 and pos["x"] + pos["w"] <= 24, where
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", where
        assert panel["targets"], f"{where}: no targets"
        for target in panel["targets"]:
            assert target.get("expr", "").strip(), f"{where}: a target without expr"
            assert target["datasource"]["uid"] == "${datasource}", where
            assert 'instance=~"$instance"' in target["expr"], f"{where}: not filtered by $instance"
            names = promql_metrics(target["expr"])
            serving = ("vllm:", "sglang:", "dynamo_", "gpufleet_gateway")
            if any(n.startswith(serving) for n in names):
                assert 'deployment=~"$deployment"' in target["expr"], \
                    f"{where}: a serving panel not filtered by $deployment"


def used_metrics():
    """{metric: [where]} for every metric an alert, a recording rule or a dashboard
    query uses."""
    used = {}
    for group in load_rules()["groups"]:
        for rule in group["rules"]:
            for name in promql_metrics(rule["expr"]):
                used.setdefault(name, []).append(rule.get("alert") or rule.get("record"))
    for panel in dashboard_panels():
        for target in panel.get("targets", []):
            for name in promql_metrics(target["expr"]):
                used.setdefault(name, []).append(f"dashboard: {panel['title']}")
    for variable in load_dashboard()["templating"]["list"]:
        query = json.dumps(variable.get("query", ""))
        for name in re.findall(r"label_values\(\s*([a-zA-Z_:][\w:]*)\s*,", query):
            used.setdefault(name, []).append(f"dashboard variable {variable['name']}")
    return used


def standin_metrics() -> dict[str, set[str]]:
    """{engine: names} the lab's stand-ins emit (as exposed: counters with _total)."""
    data = json.loads(STANDIN_METRICS.read_text())
    return {engine: {m["name"] for m in data["engines"][engine]["metrics"]}
            for engine in ("vllm", "sglang")}


def exposed(name: str) -> str:
    """A histogram's family name for one of its series' names."""
    return re.sub(r"_(bucket|sum|count)$", "", name)


def dcgm_standin_names() -> set[str]:
    return set(re.findall(r"\bDCGM_FI_[A-Z_]+\b", DCGM_STANDIN.read_text()))


def test_rules_and_dashboard_use_only_metrics_that_exist():
    used = used_metrics()
    engines = standin_metrics()
    known = METRICS | STANDARD | DYNAMO | engines["vllm"] | engines["sglang"] | \
        dcgm_standin_names()
    unknown = {name: where for name, where in used.items() if exposed(name) not in known}
    assert not unknown, f"metrics nobody writes: {unknown}"
    assert {"gpufleet_health_ok", "gpufleet_gpu_xid_fatal", "gpufleet_ib_port_up",
            "vllm:time_to_first_token_seconds_bucket", "sglang:num_queue_reqs",
            "DCGM_FI_DEV_GPU_UTIL", "gpufleet_gateway_responses_total"} <= set(used)


def test_the_docs_say_where_each_metric_was_read():
    """docs/monitoring.md's table names every metric the dashboard and the rules use that
    the checker does not write, each with where it was read."""
    table = DOC.read_text().split("## Where each metric comes from", 1)[1].split("\n## ", 1)[0]
    rows = {m.group(1): m.group(2) for m in re.finditer(
        r"^\| `([^`]+)` \|[^|]*\| (.+) \|$", table, re.MULTILINE)}
    for name in {exposed(n) for n in used_metrics()} - METRICS - {"up", "node_exporter_build_info"}:
        assert name in rows, f"{name}: not in docs/monitoring.md's table of sources"
        assert rows[name].strip(), name


def checker_metric_literals(path=CHECKER):
    """gpufleet_* names in the string literals of the checker's source."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.update(re.findall(r"\bgpufleet_[a-z_]+\b", node.value))
    return names


def test_checker_writes_every_metric_the_rules_use():
    """The list above against the checker itself: every metric in it, and every gpufleet
    metric the rules and the dashboard use, is a string literal in healthcheck.py."""
    used = used_metrics()
    wanted = METRICS | {name for name in used
                        if name.startswith("gpufleet_") and name not in STANDARD}
    missing = sorted(wanted - checker_metric_literals())
    where = {name: ", ".join(sorted(set(used.get(name, ["the list above"])))) for name in missing}
    assert not missing, "metrics that healthcheck.py does not write: " + "; ".join(
        f"{name} (used by {where[name]})" for name in missing
    )
