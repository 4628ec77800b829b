"""`fab bench`: a serving load test against a deployment, in the vLLM recipe's shape (seed 000).

The client is AIPerf (NVIDIA's OpenAI-compatible load generator, from PyPI). It lives
in its own virtual environment (.venv-bench in a checkout, else under the user's
cache directory), made on first use from gpufleet/bench-requirements.txt, because it
pins a huggingface-hub older than the one the cache code is tested with. Its tokenizer
is the deployment's own, fetched (tokenizer files only) through the same Hugging Face
endpoint the cache uses. The API key goes to AIPerf through its environment and a
`${OPENAI_API_KEY}` reference in the config file, and the deployment's CA through
SSL_CERT_FILE, never on a command line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
REQUIREMENTS = Path(__file__).with_name("bench-requirements.txt")
if (ROOT / "bench" / "results").is_dir():  # a checkout: its .venv-bench and bench/results
    VENV, RESULTS = ROOT / ".venv-bench", ROOT / "bench" / "results"
else:  # an installed package: the user's cache, and the directory fab runs in
    VENV = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpufleet" / \
        "venv-bench"
    RESULTS = Path("bench-results")
TOKENIZER_FILES = ["tokenizer*", "config.json", "generation_config.json",
                   "special_tokens_map.json", "*.jinja"]
# AIPerf metric tag -> label in the table
METRICS = {
    "time_to_first_token": "TTFT",
    "inter_token_latency": "ITL",
    "request_latency": "request latency",
    "output_token_throughput": "output tokens/s",
    "request_throughput": "requests/s",
}


class BenchError(Exception):
    pass


def is_lab(inventory: str) -> bool:
    from . import inventory as inv_mod
    return bool(inv_mod.load(inventory).vars.get("gpufleet_lab"))


def client() -> Path:
    """The aiperf executable, installed into .venv-bench the first time."""
    exe = VENV / "bin" / "aiperf"
    if exe.exists():
        return exe
    print(f"bench: installing the benchmark client ({REQUIREMENTS.name}) into {VENV} "
          "(once, a few minutes)", file=sys.stderr, flush=True)
    steps = [[sys.executable, "-m", "venv", str(VENV)],
             [str(VENV / "bin" / "pip"), "install", "-q", "-r", str(REQUIREMENTS)]]
    for cmd in steps:
        if subprocess.run(cmd, check=False).returncode != 0:
            raise BenchError(f"could not install the client: {' '.join(cmd)} failed. Fix: "
                             "check that PyPI is reachable, then run `fab bench` again")
    return exe


def tokenizer(plan) -> str:
    """The model's tokenizer files from the deployment's Hugging Face endpoint."""
    from huggingface_hub import snapshot_download

    model = plan.cache["models"][0]
    try:
        return snapshot_download(
            repo_id=model["repo"], revision=model["revision"], allow_patterns=TOKENIZER_FILES,
            endpoint=plan.cache.get("hf_endpoint") or None,
            cache_dir=Path.home() / ".cache" / "gpufleet" / "tokenizers")
    except Exception as exc:  # noqa: BLE001 - one line for the operator, not a traceback
        raise BenchError(f"could not fetch the tokenizer of {model['repo']}: "
                         f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}. Fix: set "
                         "HF_TOKEN or gpufleet_hf_endpoint as for the cache") from None


def config(plan, url: str, tokenizer_dir: str, key: bool, *, concurrency: int, prompts: int,
           input_len: int, output_len: int, artifacts: Path) -> dict:
    endpoint = {"url": url.removesuffix("/v1"), "type": "chat", "streaming": True,
                "timeout": 1800.0}
    if key:
        endpoint["api_key"] = "${OPENAI_API_KEY}"
    return {"schemaVersion": "2.0", "benchmark": {
        "model": plan.model.served_name,
        "endpoint": endpoint,
        "tokenizer": {"name": tokenizer_dir},
        "dataset": {"type": "synthetic", "entries": prompts,
                    "prompts": {"isl": input_len, "osl": output_len}},
        "profiling": {"type": "concurrency", "concurrency": concurrency, "requests": prompts},
        "artifacts": {"dir": str(artifacts), "summary": ["json"]},
    }}


def summarize(export: dict) -> dict:
    """AIPerf's profile_export_aiperf.json -> {label: {unit, avg, p50, p99}}."""
    records = export.get("records", export)
    out = {}
    for tag, label in METRICS.items():
        rec = records.get(tag)
        if isinstance(rec, dict):
            out[label] = {k: rec.get(k) for k in ("unit", "avg", "p50", "p99")}
    return out


def run(plan, key: str | None, *, concurrency: int, prompts: int, input_len: int,
        output_len: int, lab: bool, out: str | None = None) -> dict:
    exe = client()
    tok = tokenizer(plan)
    stamp = time.strftime("%Y%m%dT%H%M%S")
    artifacts = RESULTS / "aiperf" / f"{plan.target.name}-{stamp}"
    artifacts.mkdir(parents=True, exist_ok=True)
    cfg = artifacts / "aiperf.yaml"
    cfg.write_text(yaml.safe_dump(config(
        plan, plan.endpoint, tok, key is not None, concurrency=concurrency, prompts=prompts,
        input_len=input_len, output_len=output_len, artifacts=artifacts)))
    env = {**os.environ, "OPENAI_API_KEY": key or ""}
    ca = (plan.api.get("tls") or {}).get("ca_file")
    if ca:  # the client verifies the endpoint's certificate with the deployment's CA
        env["SSL_CERT_FILE"] = ca
    t0 = time.monotonic()
    proc = subprocess.run([str(exe), "profile", "--config", str(cfg)], env=env,
                          capture_output=True, text=True, check=False)
    took = time.monotonic() - t0
    exports = sorted(artifacts.rglob("profile_export_aiperf.json"))
    if proc.returncode != 0 or not exports:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
        raise BenchError("AIPerf failed (exit {}):\n{}".format(proc.returncode, "\n".join(tail)))
    result = {
        "target": plan.target.name, "endpoint": plan.endpoint,
        "engines": "lab stand-ins (not GLM-5.3: the figures measure gpufleet's serving path, "
                   "routers and gateway, not a GPU)" if lab else "real",
        "client": "aiperf (gpufleet/bench-requirements.txt)",
        "shape": {"input_tokens": input_len, "output_tokens": output_len,
                  "concurrency": concurrency, "prompts": prompts},
        "wall_s": round(took, 1),
        "metrics": summarize(json.loads(exports[-1].read_text())),
        "artifacts": str(artifacts),
    }
    path = Path(out) if out else RESULTS / f"serving-{plan.target.name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    result["json"] = str(path)
    return result


def render(result: dict) -> str:
    lines = [f"bench: {result['target']} at {result['endpoint']} with {result['client']}",
             f"engines: {result['engines']}",
             "shape: {input_tokens} in / {output_tokens} out, concurrency {concurrency}, "
             "{prompts} prompts".format(**result["shape"]),
             f"{'metric':<17} {'avg':>10} {'p50':>10} {'p99':>10}  unit"]
    for label, m in result["metrics"].items():
        cells = [f"{m[k]:>10.2f}" if isinstance(m.get(k), (int, float)) else f"{'-':>10}"
                 for k in ("avg", "p50", "p99")]
        lines.append(f"{label:<17} {' '.join(cells)}  {m.get('unit') or ''}")
    lines.append(f"wall {result['wall_s']}s; JSON: {result['json']}")
    return "\n".join(lines)
