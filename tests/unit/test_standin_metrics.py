"""The stand-ins' /metrics: the real engines' names, types, labels and buckets (metrics.json,
read from the vLLM 0.33.0 and SGLang 0.5.23 wheels), fed by the stand-in's requests.

The stand-in package is taken from its built wheel (as a lab host gets it), so this also
checks that metrics.json ships. The sources named in metrics.json are checked against the
real wheels where they are on this machine (GPUFLEET_REAL_WHEELS, default /tmp/realwheels).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
METRICS_JSON = REPO / "lab" / "standins" / "gpufleet_standin" / "metrics.json"
REAL_WHEELS = Path(os.environ.get("GPUFLEET_REAL_WHEELS", "/tmp/realwheels"))
MODEL = "zai-org/GLM-5.3-Flash"

VLLM = ["model_name", "engine"]
SCHED = ["model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank"]
TOK = ["model_name", "engine_type"]
STREAM = [*TOK, "is_streaming"]
# what the dashboard and the alerts use: name -> (type, label names)
REQUIRED = {
    "vllm": {
        "vllm:num_requests_running": ("gauge", VLLM),
        "vllm:num_requests_waiting": ("gauge", VLLM),
        "vllm:kv_cache_usage_perc": ("gauge", VLLM),
        "vllm:prompt_tokens_total": ("counter", VLLM),
        "vllm:generation_tokens_total": ("counter", VLLM),
        "vllm:num_preemptions_total": ("counter", VLLM),
        "vllm:request_success_total": ("counter", [*VLLM, "finished_reason"]),
        "vllm:time_to_first_token_seconds": ("histogram", VLLM),
        "vllm:inter_token_latency_seconds": ("histogram", VLLM),
        "vllm:e2e_request_latency_seconds": ("histogram", VLLM),
        "vllm:request_queue_time_seconds": ("histogram", VLLM),
    },
    "sglang": {
        "sglang:num_running_reqs": ("gauge", SCHED),
        "sglang:num_queue_reqs": ("gauge", SCHED),
        "sglang:token_usage": ("gauge", SCHED),
        "sglang:num_retracted_reqs": ("gauge", SCHED),
        "sglang:prompt_tokens_total": ("counter", STREAM),
        "sglang:generation_tokens_total": ("counter", STREAM),
        "sglang:num_requests_total": ("counter", STREAM),
        "sglang:num_aborted_requests_total": ("counter", TOK),
        "sglang:time_to_first_token_seconds": ("histogram", STREAM),
        "sglang:inter_token_latency_seconds": ("histogram", TOK),
        "sglang:e2e_request_latency_seconds": ("histogram", STREAM),
        "sglang:queue_time_seconds": ("histogram", SCHED),
    },
}
REASONS = ["stop", "length", "abort", "error", "repetition"]  # vllm/v1/engine/__init__.py:37


# --- a strict parser of the text format (prometheus_client is not in the venv) ----------
NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
SAMPLE = re.compile(rf"({NAME})\{{(.*)\}} (\S+)")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
SUFFIXES = {"gauge": [""], "counter": [""], "histogram": ["_bucket", "_count", "_sum"]}


def parse(text: str) -> dict:
    """{family: {"type", "help", "samples": [(name, {label: value}, float)]}}; fails on
    anything the text format (0.0.4) does not allow or prometheus_client would not write."""
    assert text.endswith("\n")
    families: dict = {}
    family = None
    for line in text[:-1].split("\n"):
        if line.startswith("# HELP "):
            name, _, help_ = line[7:].partition(" ")
            assert re.fullmatch(NAME, name) and name not in families, line
            family = families[name] = {"help": help_, "type": None, "samples": []}
            current = name
        elif line.startswith("# TYPE "):
            name, _, kind = line[7:].partition(" ")
            assert name == current and family["type"] is None, line
            assert kind in SUFFIXES, line
            family["type"] = kind
        else:
            m = SAMPLE.fullmatch(line)
            assert m and family and family["type"], line
            name, body, value = m.groups()
            assert name in [current + s for s in SUFFIXES[family["type"]]], line
            pairs = LABEL.findall(body)
            assert ",".join(f'{k}="{v}"' for k, v in pairs) == body, line
            labels = dict(pairs)
            assert len(labels) == len(pairs), line
            key = (name, tuple(pairs))
            assert key not in {(n, tuple(ls.items())) for n, ls, _ in family["samples"]}, line
            family["samples"].append((name, labels, float(value)))
    try:  # where prometheus_client is installed, it must read the text too
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:
        pass
    else:
        assert len(list(text_string_to_metric_families(text))) == len(families)
    return families


def total(families: dict, name: str, **labels) -> float:
    """The sum of the samples called `name` (a family, or a histogram's _count, _sum)."""
    family = name if name in families else re.sub(r"_(count|sum)$", "", name)
    return sum(v for n, ls, v in families[family]["samples"]
               if n == name and labels.items() <= ls.items())


# --- the stand-in package, from its wheel ------------------------------------------------
@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    """gpufleet_standin as the vLLM stand-in wheel vendors it (vllm/_standin)."""
    spec = importlib.util.spec_from_file_location(
        "standins_build", REPO / "lab" / "standins" / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    tmp = tmp_path_factory.mktemp("standin_metrics")
    dists = build.dists()
    pkg = tmp / "pkg" / "standin_metrics_under_test"
    for name in ("vllm", "sglang"):
        wheel = build.write_wheel(tmp, name, dists[name], dists[name]["version"])
        with zipfile.ZipFile(wheel) as zf:
            assert zf.read(f"{name}/_standin/metrics.json") == METRICS_JSON.read_bytes()
            assert "histogram_buckets" not in json.loads(zf.read(f"{name}/_standin/standin.json"))
            for item in zf.namelist() if name == "vllm" else []:
                if item.startswith("vllm/_standin/"):
                    dest = pkg / item.removeprefix("vllm/_standin/")
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    dest.write_bytes(zf.read(item))
    sys.path.insert(0, str(pkg.parent))
    try:
        yield (importlib.import_module(f"{pkg.name}.metrics"),
               importlib.import_module(f"{pkg.name}.model"))
    finally:
        sys.path.remove(str(pkg.parent))


def serve(metrics, model, prompt, generated, reason, status=None, **kw):
    """One request through Metrics as server.py does: begin(), then end() in a `finally`
    (with the request's exception unwinding, if any)."""
    start = metrics.begin()
    try:
        try:
            if status:
                raise model.RequestError("failed", status)
        finally:
            metrics.end(start, prompt, generated, reason, **kw)
    except model.RequestError:
        pass


@pytest.fixture
def traffic(standin):
    """A Metrics after: stop (10 tokens), tool_calls (streamed, 4), length (1), a request
    rejected before it ran (400), one that failed in the engine (500), one in flight."""
    mod, model = standin
    metrics = mod.Metrics()
    serve(metrics, model, 12, 10, "stop", queued=0.0)
    serve(metrics, model, 30, 4, "tool_calls", stream=True)
    serve(metrics, model, 5, 1, "length")
    serve(metrics, model, 0, 0, None, status=400)
    serve(metrics, model, 0, 0, None, status=500)
    metrics.begin()
    return metrics


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_required_metrics_present_with_real_types_and_labels(traffic, engine):
    families = parse(traffic.render(engine, MODEL))
    for name, (kind, labels) in REQUIRED[engine].items():
        assert name in families, name
        assert families[name]["type"] == kind, name
        assert families[name]["samples"], name
        for sample, got, _ in families[name]["samples"]:
            assert [k for k in got if k != "le"] == labels, sample
            assert got["model_name"] == MODEL
    data = {m["name"]: m for m in json.loads(METRICS_JSON.read_text())["engines"][engine]
            ["metrics"]}
    assert list(families) == list(data)  # the stand-in emits exactly what metrics.json says
    for name, family in families.items():
        assert (family["type"], family["help"]) == (data[name]["type"], data[name]["help"])
    assert "vllm:gpu_cache_usage_perc" not in families


def test_vllm_series_and_error_accounting(traffic):
    f = parse(traffic.render("vllm", MODEL))
    reasons = {ls["finished_reason"]: v for n, ls, v in f["vllm:request_success_total"]
               ["samples"]}
    # every FinishReason from startup; tool_calls is "stop" to the engine; the 400 uncounted
    assert reasons == {"stop": 2, "length": 1, "abort": 0, "error": 1, "repetition": 0}
    assert all(ls["engine"] == "0" for n, ls, v in f["vllm:prompt_tokens_total"]["samples"])
    assert total(f, "vllm:prompt_tokens_total") == 47
    assert total(f, "vllm:generation_tokens_total") == 15
    assert total(f, "vllm:num_preemptions_total") == 0
    assert total(f, "vllm:num_requests_running") == 1
    assert total(f, "vllm:num_requests_waiting") == 0
    assert total(f, "vllm:kv_cache_usage_perc") == 0.01
    assert total(f, "vllm:time_to_first_token_seconds_count") == 3  # not the failed one
    assert total(f, "vllm:inter_token_latency_seconds_count") == 9 + 3 + 0
    assert total(f, "vllm:e2e_request_latency_seconds_count") == 4
    assert total(f, "vllm:request_queue_time_seconds_count") == 4


def test_sglang_series_and_error_accounting(traffic, standin):
    f = parse(traffic.render("sglang", MODEL))
    assert total(f, "sglang:num_requests_total") == 4
    assert total(f, "sglang:num_requests_total", is_streaming="true") == 1
    assert total(f, "sglang:num_aborted_requests_total") == 1
    assert total(f, "sglang:prompt_tokens_total", is_streaming="false") == 17
    assert total(f, "sglang:generation_tokens_total") == 15
    assert total(f, "sglang:num_running_reqs") == 1
    assert total(f, "sglang:num_retracted_reqs") == 0
    assert total(f, "sglang:time_to_first_token_seconds_count") == 3
    assert total(f, "sglang:inter_token_latency_seconds_count") == 12
    assert total(f, "sglang:queue_time_seconds_count") == 4
    labels = f["sglang:num_running_reqs"]["samples"][0][1]
    assert labels == {"model_name": MODEL, "engine_type": "unified", "tp_rank": "0",
                      "pp_rank": "0", "moe_ep_rank": "0"}
    # SGLang makes a series at its first observation: no abort, no series
    fresh = parse(standin[0].Metrics().render("sglang", MODEL))
    assert not fresh["sglang:num_aborted_requests_total"]["samples"]
    assert not fresh["sglang:prompt_tokens_total"]["samples"]
    assert fresh["sglang:token_usage"]["samples"]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_histograms_consistent(traffic, engine):
    data = {m["name"]: m for m in json.loads(METRICS_JSON.read_text())["engines"][engine]
            ["metrics"]}
    families = parse(traffic.render(engine, MODEL))
    for name, family in families.items():
        if family["type"] != "histogram":
            continue
        series: dict = {}
        for sample, labels, value in family["samples"]:
            key = tuple((k, v) for k, v in labels.items() if k != "le")
            series.setdefault(key, {"buckets": []})
            if sample.endswith("_bucket"):
                series[key]["buckets"].append((labels["le"], value))
            else:
                series[key][sample[len(name) + 1:]] = value
        assert series, name
        for key, s in series.items():
            bounds = [le for le, _ in s["buckets"]]
            counts = [c for _, c in s["buckets"]]
            assert bounds[-1] == "+Inf" and counts[-1] == s["count"], (name, key)
            assert [float(b) for b in bounds[:-1]] == data[name]["buckets"], name
            assert counts == sorted(counts), (name, key)  # cumulative
            assert s["sum"] >= 0 and (s["count"] > 0 or s["sum"] == 0), (name, key)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_counters_increase(traffic, standin, engine):
    counters = [n for n, (k, _) in REQUIRED[engine].items() if k == "counter"
                and "abort" not in n and "preemption" not in n]
    before = parse(traffic.render(engine, MODEL))
    serve(traffic, standin[1], 8, 6, "stop")
    after = parse(traffic.render(engine, MODEL))
    for name in counters:
        assert total(after, name) > total(before, name), name
    count = next(n for n in REQUIRED[engine] if n.endswith("e2e_request_latency_seconds"))
    assert total(after, count + "_count") == total(before, count + "_count") + 1


def test_timing_shares_the_paced_time(standin):
    """A request of n tokens: TTFT one step after its queue time, n-1 steps between tokens,
    together its end-to-end time."""
    metrics = standin[0].Metrics()
    start = metrics.begin()
    metrics.end(start - 2.0, 3, 4, "stop", queued=0.4)
    f = parse(metrics.render("vllm", MODEL))
    e2e = total(f, "vllm:e2e_request_latency_seconds_sum")
    ttft = total(f, "vllm:time_to_first_token_seconds_sum")
    itl = total(f, "vllm:inter_token_latency_seconds_sum")
    assert e2e >= 2.0 and total(f, "vllm:request_queue_time_seconds_sum") == 0.4
    assert math.isclose(ttft + itl, e2e) and math.isclose(itl / 3, (e2e - 0.4) / 4)


# --- metrics.json against the real wheels ------------------------------------------------
SOURCE = re.compile(r"(vllm-0\.33\.0|sglang-0\.5\.23) wheel, ((?:vllm|sglang)/[\w/]+\.py):(\d+)")


def _wheel_text(dist: str, path: str) -> str | None:
    wheels = sorted(REAL_WHEELS.glob(f"{dist}-*.whl"))
    if not wheels:
        return None
    with zipfile.ZipFile(wheels[0]) as zf:
        assert path in zf.namelist(), f"{path} is not in {wheels[0].name}"
        return zf.read(path).decode()


def test_metrics_json_sources():
    data = json.loads(METRICS_JSON.read_text())
    checked = 0
    for engine, spec in data["engines"].items():
        for m in spec["metrics"]:
            for key in ("source", "buckets_source") if m["type"] == "histogram" else ("source",):
                match = SOURCE.fullmatch(m[key])
                assert match and match[1].startswith(engine), (m["name"], m[key])
                text = _wheel_text(match[1], match[2])
                if text is None:
                    continue
                lines = text.splitlines()[int(match[3]) - 1:]
                if key == "source":  # the line of name="..." (prometheus_client adds _total)
                    registered = m["name"][:-6] if engine == "vllm" and m["type"] == "counter" \
                        else m["name"]
                    assert f'name="{registered}"' in lines[0], (m["name"], lines[0])
                    assert f'"{m["help"]}"' in "\n".join(lines[:4]), m["name"]
                else:  # the default bounds, from this line to the closing bracket
                    body = "\n".join(lines).split("=", 1)[1]
                    body = body[:min(i for i in (body.find(")"), body.find("]")) if i > 0)]
                    numbers = [float(x) for x in re.findall(r"\d+(?:\.\d+)?", body)]
                    assert numbers == m["buckets"], m["name"]
                checked += 1
    if not checked:
        pytest.skip(f"source format checked; the real wheels are not in {REAL_WHEELS} "
                    "(pip download --no-deps vllm==0.33.0 sglang==0.5.23)")
