"""`fab bench`'s pieces that need no deployment: the AIPerf config carries a reference to
the key, never the key, and takes seed 000's shape; the summary and the table read
AIPerf's export."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from gpufleet import bench
from gpufleet.plan import make_plan

SEED_SHAPE = {"concurrency": 16, "prompts": 64, "input_len": 8192, "output_len": 1024}


def test_the_config_has_the_seed_shape_and_only_a_reference_to_the_key(tmp_path):
    plan = make_plan("h200-pd-1node")
    cfg = bench.config(plan, plan.endpoint, "/tok", True, artifacts=tmp_path, **SEED_SHAPE)
    text = yaml.safe_dump(cfg)
    b = cfg["benchmark"]
    assert b["endpoint"]["api_key"] == "${OPENAI_API_KEY}"
    assert b["endpoint"]["url"] == plan.endpoint.removesuffix("/v1")
    assert b["endpoint"]["streaming"] is True
    assert b["dataset"]["prompts"] == {"isl": 8192, "osl": 1024}
    assert b["profiling"] == {"type": "concurrency", "concurrency": 16, "requests": 64}
    assert b["model"] == "zai-org/GLM-5.3-Flash" and "sk-" not in text
    without = bench.config(plan, plan.endpoint, "/tok", False, artifacts=tmp_path,
                           **SEED_SHAPE)
    assert "api_key" not in without["benchmark"]["endpoint"]


def test_summary_and_table_from_an_aiperf_export():
    export = {"records": {
        "time_to_first_token": {"unit": "ms", "avg": 12.5, "p50": 11.0, "p99": 30.2},
        "inter_token_latency": {"unit": "ms", "avg": 1.5, "p50": 1.4, "p99": 2.0},
        "output_token_throughput": {"unit": "tokens/sec", "avg": 900.0},
    }}
    metrics = bench.summarize(export)
    assert metrics["TTFT"] == {"unit": "ms", "avg": 12.5, "p50": 11.0, "p99": 30.2}
    assert "requests/s" not in metrics
    table = bench.render({"target": "t", "endpoint": "e", "client": "aiperf",
                          "engines": "lab stand-ins", "wall_s": 3.0, "json": "x.json",
                          "shape": {"input_tokens": 8192, "output_tokens": 1024,
                                    "concurrency": 16, "prompts": 64},
                          "metrics": metrics})
    assert "TTFT" in table and "30.20" in table and "lab stand-ins" in table
    assert "output tokens/s       900.00          -          -" in table


def test_the_client_is_pinned_in_its_own_requirements_file():
    req = Path(bench.REQUIREMENTS).read_text()
    assert "aiperf==" in req
    json.dumps(bench.METRICS)  # labels are plain data
