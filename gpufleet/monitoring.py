"""What Prometheus needs to scrape a deployment: its targets as a file_sd file, and the job.

Every host of a deployment whose inventory sets gpufleet_metrics_allow runs a metrics
listener (roles/serve) on its address at gpufleet_metrics_port: /metrics/PROCESS there is
that process's own /metrics (an engine's, a router's, Dynamo's frontend's or a worker's
system server's, etcd's), to the allowed addresses only. The targets come from the plan
(`monitoring.targets`); each carries the labels a fleet of several deployments needs:
`deployment` (plan.deployment_id), `target`, `host` (also `instance`, which the host
alerts name), `role`, `process`. The engines' own labels (vLLM's `model_name` and
`engine`, SGLang's `model_name`, `tp_rank`, ...) stay as they are. The health checker's
metrics are the `health` process of every host.

The serving alerts (monitoring/gpufleet-alerts.yml) compare with the deployment's bounds
(gpufleet_alert_bounds): a rules file of recording rules, gpufleet_alert_bound{deployment,
bound}, written beside the targets.
"""

from __future__ import annotations

import json
import os
import tempfile

JOB = "gpufleet"
ALERTS = "gpufleet-alerts.yml"  # monitoring/'s, written beside the targets


def file_sd(monitoring: dict) -> list[dict]:
    """Prometheus file_sd target groups: one per process, its path in __metrics_path__."""
    listener = monitoring["listener"]
    return [{"targets": [f"{t['address']}:{listener['port']}"],
             "labels": {"__metrics_path__": t["path"], "deployment": monitoring["deployment"],
                        "target": monitoring["target"], "host": t["host"],
                        "instance": t["host"], "role": t["role"],
                        "process": t["process"]}}
            for t in monitoring["targets"]]


def scrape_config(folder: str) -> str:
    """The job to add to prometheus.yml's scrape_configs: every deployment's file in
    FOLDER (Prometheus rereads the files when they change, without a reload)."""
    folder = folder.rstrip("/")
    return (f"  - job_name: {JOB}\n"
            f"    file_sd_configs:\n"
            f"      - files: ['{folder}/*.json']\n")


def rule_files(folder: str) -> str:
    """What prometheus.yml's rule_files lists: the alerts and every deployment's bounds."""
    folder = folder.rstrip("/")
    return f"rule_files:\n  - {folder}/{ALERTS}\n  - {folder}/*.rules.yml\n"


def bound_rules(monitoring: dict) -> str:
    """The deployment's alert bounds as Prometheus recording rules (YAML; JSON is YAML)."""
    rules = [{"record": "gpufleet_alert_bound", "expr": f"vector({value!r})",
              "labels": {"deployment": monitoring["deployment"], "bound": bound}}
             for bound, value in sorted(monitoring["bounds"].items())]
    return json.dumps({"groups": [{"name": f"gpufleet-bounds-{monitoring['deployment']}",
                                   "rules": rules}]}, indent=2) + "\n"


def _atomic(folder: str, name: str, text: str) -> str:
    """FOLDER/NAME written atomically (Prometheus watches the folder and must never read
    half a file); its path."""
    path = os.path.join(folder, name)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".gpufleet-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def write(monitoring: dict, folder: str, alerts: str) -> list[str]:
    """The deployment's targets (FOLDER/DEPLOYMENT.json), its alert bounds
    (FOLDER/DEPLOYMENT.rules.yml) and the alert rules every deployment shares (ALERTS,
    monitoring/gpufleet-alerts.yml, as FOLDER/gpufleet-alerts.yml); their paths."""
    os.makedirs(folder, exist_ok=True)
    name = monitoring["deployment"]
    with open(alerts, encoding="utf-8") as fh:
        rules = fh.read()
    return [_atomic(folder, f"{name}.json", json.dumps(file_sd(monitoring), indent=2) + "\n"),
            _atomic(folder, f"{name}.rules.yml", bound_rules(monitoring)),
            _atomic(folder, ALERTS, rules)]
