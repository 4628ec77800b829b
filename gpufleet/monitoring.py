"""What Prometheus needs to scrape a deployment: its targets as a file_sd file, and the job.

Every host of a deployment whose inventory sets gpufleet_metrics_allow runs a metrics
listener (roles/serve) on its address at gpufleet_metrics_port: /metrics/PROCESS there is
that process's own /metrics (an engine's, a router's, Dynamo's frontend's or a worker's
system server's, etcd's), to the allowed addresses only. The targets come from the plan
(`monitoring.targets`); each carries the labels a fleet of several deployments needs:
`deployment` (plan.deployment_id), `target`, `host`, `role`, `process`. The engines' own
labels (vLLM's `model_name` and `engine`, SGLang's `model_name`, `tp_rank`, ...) stay as
they are.
"""

from __future__ import annotations

import json
import os
import tempfile

JOB = "gpufleet"


def file_sd(monitoring: dict) -> list[dict]:
    """Prometheus file_sd target groups: one per process, its path in __metrics_path__."""
    listener = monitoring["listener"]
    return [{"targets": [f"{t['address']}:{listener['port']}"],
             "labels": {"__metrics_path__": t["path"], "deployment": monitoring["deployment"],
                        "target": monitoring["target"], "host": t["host"], "role": t["role"],
                        "process": t["process"]}}
            for t in monitoring["targets"]]


def scrape_config(folder: str) -> str:
    """The job to add to prometheus.yml's scrape_configs: every deployment's file in
    FOLDER (Prometheus rereads the files when they change, without a reload)."""
    return (f"  - job_name: {JOB}\n"
            f"    file_sd_configs:\n"
            f"      - files: ['{folder.rstrip('/')}/*.json']\n")


def write(monitoring: dict, folder: str) -> str:
    """The deployment's targets written to FOLDER/DEPLOYMENT.json (atomically: Prometheus
    watches the folder and must never read half a file); its path."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{monitoring['deployment']}.json")
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".gpufleet-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(file_sd(monitoring), fh, indent=2)
            fh.write("\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path
