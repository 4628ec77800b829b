"""`fab bench`'s pieces that need no deployment: the AIPerf config carries a reference to
the key, never the key, and takes the vLLM recipe's shape (seed 000); the summary and the table read
AIPerf's export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
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


def _bench_module(name: str):
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cache_bench_short_run_moves_each_byte_once(tmp_path):
    # the short smoke version of bench/cache_bench.py: small shards, one round; what must
    # hold at any size is that 4 fetchers on one cache pull what 1 does, and a re-run none
    out = tmp_path / "cache.json"
    assert _bench_module("cache_bench").main(
        ["--shard-mib", "2", "--rounds", "1", "--host-mib", "40", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    total = result["fetchers_1"]["bytes_from_mirror"]
    assert total == result["raw_http"]["bytes_from_mirror"] > 0
    assert result["fetchers_4"]["bytes_from_mirror"] == total
    assert sorted(result["fetchers_4"]["downloaded_by"])[:3] == [0, 0, 0]
    assert result["rerun_complete_cache"]["bytes_from_mirror"] == 0
    assert result["ratio_cache_fetch_to_raw"] > 0
    assert result["raw_http_sha256"]["bytes_from_mirror"] == total
    assert result["ratio_cache_fetch_to_hashing_raw"] > 0
    assert result["cache_fetch"]["cpu_s_per_gib"] > 0
    assert set(result["goals"]) == {"ratio_cache_fetch_to_hashing_raw",
                                    "cache_fetch_cpu_s_per_gib",
                                    "bytes_from_mirror_4_fetchers_over_1",
                                    "fetch_hosts_2_over_1", "bytes_from_mirror_2_hosts_over_1"}
    assert result["rate_limit"] is None
    hosts = result["fetch_hosts"]
    # two hosts, a share each, then the completing run: every byte once, none by the last
    assert hosts["one_host"]["bytes_from_mirror"] == hosts["two_hosts"]["bytes_from_mirror"] \
        == total
    shares = hosts["two_hosts"]["downloaded_by"]
    assert shares[0] > 0 and shares[1] > 0 and shares[2] == 0 and sum(shares) == total


def test_cache_bench_hashing_copy_on_a_rate_limited_mirror(tmp_path):
    # the ceiling copy checks what it hashed, and --rate-limit-mib reaches the mirror
    cache_bench = _bench_module("cache_bench")
    mirror, url = cache_bench.start_mirror(1, rate_limit_mib=8)
    try:
        files = cache_bench.engine_files(url)
        total = sum(size for _, size, _ in files)
        assert [sha for path, _, sha in files if path.endswith(".safetensors")][0]
        secs, sent = cache_bench.copy_round(url, files, tmp_path / "ok", 4, True)
        assert sent == total and secs >= 0.8 * total / (8 * cache_bench.MIB)
        path, size, _ = next(f for f in files if f[0].endswith(".safetensors"))
        with pytest.raises(SystemExit, match="does not match"):
            cache_bench.raw_copy(url, [(path, size, "0" * 64)], tmp_path, 1, verify=True)
    finally:
        mirror.terminate()
        mirror.wait()


PROFILE_OUTPUT = """\
PLAY RECAP *********************************************************************
lab1                       : ok=170  changed=0    unreachable=0    failed=0    skipped=40
lab2                       : ok=174  changed=3    unreachable=0    failed=0    skipped=36
localhost                  : ok=11   changed=1    unreachable=0    failed=0    skipped=1

Sunday 29 November 2026  15:52:02 +0000 (0:00:00.083)       0:00:31.985 *******
===============================================================================
cache : Cache | Fetch | Download and verify (token on stdin only) ------- 2.77s
serve : Serve | Ready | Health and one token: prefill ------------------- 2.34s
"""


def test_converge_bench_reads_ansible_output_and_writes_ansible_defaults(tmp_path):
    converge = _bench_module("converge")
    assert converge.changed(PROFILE_OUTPUT) == 4
    assert converge.task_times(PROFILE_OUTPUT) == [
        ("cache : Cache | Fetch | Download and verify (token on stdin only)", 2.77),
        ("serve : Serve | Ready | Health and one token: prefill", 2.34)]
    import configparser

    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read(converge.defaults_cfg(tmp_path))
    for key in ("forks", "fact_caching", "gathering"):
        assert key not in cfg["defaults"]
    assert cfg["ssh_connection"]["pipelining"] == "False"
    assert "ControlMaster=no" in cfg["ssh_connection"]["ssh_args"]
    assert Path(cfg["defaults"]["collections_path"]).is_absolute()
    assert converge.machine_cpu_s() > 0
