"""The real vLLM's /metrics against what gpufleet assumes: the stand-in's families
(lab/standins/gpufleet_standin/metrics.json) and what the dashboard, the recording rules and
the alerts read. Shared by the real-engine tests (test_real_vllm_cpu.py, test_lab_cpu.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "unit"))
from test_monitoring import exposed, used_metrics  # noqa: E402 - the unit suite's readers
from test_standin_metrics import parse as parse_exposition  # noqa: E402

METRICS_JSON = ROOT / "lab" / "standins" / "gpufleet_standin" / "metrics.json"


def vllm_families(text: str) -> dict[str, dict]:
    """The vllm:* families of an exposition, read by the unit suite's strict parser of the
    text format: name -> {"type", "labels": label names of its samples (without le),
    "buckets": a histogram's finite bounds in order}."""
    mine = "".join(line + "\n" for line in text.splitlines()
                   if line.startswith(("vllm:", "# HELP vllm:", "# TYPE vllm:")))
    out = {}
    for name, family in parse_exposition(mine).items():
        bounds = [float(labels["le"]) for sample, labels, _ in family["samples"]
                  if sample.endswith("_bucket") and labels["le"] != "+Inf"]
        out[name] = {"type": family["type"],
                     "labels": {k for _, labels, _ in family["samples"] for k in labels} - {"le"},
                     "buckets": list(dict.fromkeys(bounds))}
    return out


def differences(text: str, release: str) -> list[str]:
    """What differs between a real vLLM's /metrics text and the stand-in's families, and
    what the dashboard or the alerts read that it does not expose ([]: nothing)."""
    real = vllm_families(text)
    claimed = json.loads(METRICS_JSON.read_text())["engines"]["vllm"]["metrics"]
    wrong = []
    for m in claimed:
        got = real.get(m["name"])
        if got is None:
            wrong.append(f"{m['name']}: not exposed by vLLM {release}")
            continue
        if got["type"] != m["type"]:
            wrong.append(f"{m['name']}: {got['type']}, the stand-in says {m['type']}")
        if got["labels"] and got["labels"] != set(m["labels"]):
            wrong.append(f"{m['name']}: labels {sorted(got['labels'])}, the stand-in's "
                         f"{sorted(m['labels'])}")
        if m["type"] == "histogram" and got["buckets"] != m["buckets"]:
            wrong.append(f"{m['name']}: buckets {got['buckets']}, the stand-in's "
                         f"{m['buckets']}")
    used = {exposed(n) for n in used_metrics() if n.startswith("vllm:")}
    if not used:
        wrong.append("the dashboard and the alerts read no vllm:* metric (the reader broke?)")
    wrong += [f"{n}: read by the dashboard or the alerts, not exposed" for n in sorted(used)
              if n not in real]
    return wrong
