"""The lab's stand-in engines, installed from their wheels into a clean venv.

Loopback only: a fake hw.json, a tiny Hugging Face cache, ephemeral ports.
"""

from __future__ import annotations

import base64
import concurrent.futures
import importlib.util
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

REPO = Path(__file__).resolve().parents[2]
FLASH, GLM = "zai-org/GLM-5.3-Flash", "zai-org/GLM-5.3"
H200 = {"arch": "hopper", "gpus": [{"index": i, "name": "NVIDIA H200", "memory_mib": 143771}
                                   for i in range(8)]}
B200 = {"arch": "blackwell", "gpus": [{"index": i, "name": "NVIDIA B200", "memory_mib": 183359}
                                      for i in range(8)]}
_VENVS: dict = {}


def _build_module():
    spec = importlib.util.spec_from_file_location(
        "standins_build", REPO / "lab" / "standins" / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def make_venv(root: Path, flashinfer: str = "0.6.18", cubin: str | None = None) -> Path:
    """A plain venv with the stand-in wheels installed the way a lab host installs them."""
    key = (flashinfer, cubin)
    if key in _VENVS:
        return _VENVS[key]
    name = f"venv-{flashinfer}-{cubin}"
    wheels = root / f"wheels-{flashinfer}-{cubin}"
    _build_module().build(wheels, flashinfer, cubin)
    venv = root / name
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"),
                    "install", "-q", "--no-index", "--find-links", str(wheels), "vllm",
                    "sglang", "flashinfer-python", "flashinfer-cubin"], check=True)
    _VENVS[key] = venv
    return venv


@pytest.fixture(scope="session")
def venv_root(tmp_path_factory):
    return tmp_path_factory.mktemp("standins")


@pytest.fixture(scope="session")
def venv(venv_root):
    return make_venv(venv_root)


def write_cache(root: Path) -> Path:
    hub = root / "hub"
    configs = {
        FLASH: {"architectures": ["Glm5FlashForConditionalGeneration"],
                "model_type": "glm5_flash", "max_position_embeddings": 1048576,
                "vision_config": {"model_type": "glm5_flash_vision"}},
        GLM: {"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa",
              "max_position_embeddings": 1048576},
    }
    for repo, config in configs.items():
        base = hub / ("models--" + repo.replace("/", "--"))
        snap = base / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
        snap.mkdir(parents=True)
        (snap / "config.json").write_text(json.dumps(config))
        (base / "refs").mkdir()
        (base / "refs" / "main").write_text(snap.name)
    return hub


def lab_env(root: Path, venv: Path, hw: dict = H200, **extra) -> dict:
    hw_file = root / f"hw-{hw['arch']}-{len(hw['gpus'])}.json"
    hw_file.write_text(json.dumps(hw))
    hub = root / "hub"
    if not hub.exists():
        write_cache(root)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_", "VLLM_", "HF_"))}
    env.update(HF_HUB_CACHE=str(hub), HF_HUB_OFFLINE="1", GPUFLEET_LAB_HW=str(hw_file),
               GPUFLEET_LAB_START_SECONDS="0.3", PATH=f"{venv / 'bin'}:{env['PATH']}",
               # the compile caches in the test's directory, not the user's home
               VLLM_CACHE_ROOT=str(root / "compile" / "vllm"),
               SGLANG_JIT_CACHE_ROOT=str(root / "compile" / "sglang"),
               GPUFLEET_LAB_COMPILE_SECONDS="0.2")
    env.update(extra)
    return env


@pytest.fixture
def env(tmp_path, venv):
    return lab_env(tmp_path, venv)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def argv_of(cmd: str, venv: Path) -> list[str]:
    argv = shlex.split(cmd)
    if argv[0] == "python":
        argv[0] = str(venv / "bin" / "python")
    return argv


def run_fail(cmd: str, env: dict, venv: Path) -> subprocess.CompletedProcess:
    return subprocess.run(argv_of(cmd, venv), env=env, capture_output=True, text=True,
                          timeout=30)


def http(url: str, body: dict | None = None, headers: dict | None = None, timeout=10):
    """(status, text) of a GET (body None) or JSON POST."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data, {"Content-Type": "application/json",
                                             **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


class Server:
    def __init__(self, cmd: str, env: dict, venv: Path, log: Path, port: int):
        self.port, self.log = port, log
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(argv_of(cmd, venv), env=env, stdout=log.open("w"),
                                     stderr=subprocess.STDOUT)

    def wait(self, path="/health", timeout=20.0) -> Server:
        end = time.time() + timeout
        while time.time() < end:
            if self.proc.poll() is not None:
                raise AssertionError(f"exited {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                if http(self.url + path, timeout=2)[0] == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"not ready:\n{self.log.read_text()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def start(tmp_path, venv):
    servers = []

    def _start(cmd: str, env: dict, wait=True, path="/health") -> Server:
        port = free_port()
        cmd = cmd.replace("PORT", str(port))
        server = Server(cmd, env, venv, tmp_path / f"server-{len(servers)}.log", port)
        servers.append(server)
        return server.wait(path) if wait else server

    yield _start
    for server in servers:
        server.stop()


def client(server: Server, key: str = "EMPTY") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=20)


VLLM_FULL = (f"vllm serve {FLASH} --port PORT --host 127.0.0.1 --tensor-parallel-size 4 "
             "--tool-call-parser glm47 --reasoning-parser glm45 --enable-auto-tool-choice "
             f"--served-model-name {FLASH} --limit-mm-per-prompt '{{\"image\":1}}'")
SGLANG_FULL = (f"python -m sglang.launch_server --model-path {GLM} --tp-size 8 --port PORT "
               "--host 127.0.0.1 --reasoning-parser auto --tool-call-parser auto "
               "--mem-fraction-static 0.8 --enable-metrics")
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
ASK_WEATHER = [{"role": "user", "content": "What's the weather in Paris?"}]
READY = [{"role": "user", "content": "Reply with exactly: READY"}]
PNG = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(16)).decode()


def reasoning(message) -> str | None:
    return (message.model_extra or {}).get("reasoning_content")


# --- command line --------------------------------------------------------------------
@pytest.mark.parametrize("cmd, expected", [
    (f"vllm serve {FLASH} --tensor-parallel-size 4 --no-such-flag", "unrecognized arguments"),
    (f"vllm serve {FLASH} --dtype fp7", "argument --dtype: invalid choice: 'fp7'"),
    (f"vllm serve {FLASH} --speculative-config '{{\"method\":'", "not valid JSON"),
    (f"python -m sglang.launch_server --model-path {GLM} --no-such-flag 1",
     "unrecognized arguments"),
    (f"python -m sglang.launch_server --model-path {GLM} --kv-cache-dtype fp9",
     "argument --kv-cache-dtype: invalid choice"),
    (f"python -m sglang.launch_server --model-path {GLM} --disaggregation-mode both",
     "argument --disaggregation-mode: invalid choice"),
])
def test_rejects_what_argparse_rejects(cmd, expected, env, venv):
    result = run_fail(cmd, env, venv)
    assert result.returncode == 2, result.stderr
    assert "usage:" in result.stderr and expected in result.stderr


def test_versions_and_entry_points(venv, env):
    out = subprocess.run([venv / "bin" / "python", "-c",
                          "import importlib.metadata as m, vllm, sglang, flashinfer;"
                          "print([m.version(d) for d in ('vllm', 'sglang', 'flashinfer-python',"
                          " 'flashinfer-cubin')], vllm.__version__, sglang.__version__)"],
                         env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["['0.33.0',", "'0.5.23',", "'0.6.18',", "'0.6.18']", "0.33.0",
                           "0.5.23"]
    assert run_fail("vllm --version", env, venv).stdout.strip() == "0.33.0"


# --- start-up refusals ---------------------------------------------------------------
@pytest.mark.parametrize("cmd, extra, expected", [
    (f"vllm serve {FLASH} -tp 16", {}, "World size (16) is larger than the number of "
     "available GPUs (8)"),
    (f"vllm serve {FLASH} -tp 4", {"CUDA_VISIBLE_DEVICES": "0,1"},
     "World size (4) is larger than the number of available GPUs (2)"),
    (f"vllm serve {FLASH} -tp 4 -dp 2", {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, "World size (8)"),
    (f"python -m sglang.launch_server --model-path {GLM} --tp-size 8",
     {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, "CUDA error: invalid device ordinal"),
    (f"vllm serve {FLASH} -tp 2", {}, "CUDA out of memory"),
    (f"vllm serve {FLASH} -tp 4 --gpu-memory-utilization 0.5", {},
     "No available memory for the cache blocks"),
    (f"python -m sglang.launch_server --model-path {GLM} --tp-size 8 "
     "--mem-fraction-static 0.6", {}, "Not enough memory. Please try to increase "
     "--mem-fraction-static"),
    (f"vllm serve {FLASH} -tp 4 --kv-cache-dtype fp8", {}, "not supported for "
     f"{FLASH} on Hopper"),
    (f"python -m sglang.launch_server --model-path {FLASH} --tp-size 4 "
     "--kv-cache-dtype fp8_e4m3", {}, "on Hopper"),
    ("vllm serve zai-org/GLM-5.3-BF16 -tp 8", {}, "outgoing traffic has been disabled"),
    (f"vllm serve {FLASH} -tp 4 --tool-call-parser glm99", {}, "invalid tool call parser"),
    (f"vllm serve {FLASH} -tp 4 --enable-auto-tool-choice", {},
     "--enable-auto-tool-choice requires --tool-call-parser"),
])
def test_refuses_to_start(cmd, extra, expected, env, venv):
    result = run_fail(cmd, {**env, **extra}, venv)
    assert result.returncode == 1, result.stderr
    assert expected in result.stderr


def test_fp8_kv_is_fine_on_blackwell(tmp_path, venv, start):
    env = lab_env(tmp_path, venv, B200)
    server = start(f"vllm serve {FLASH} --port PORT --host 127.0.0.1 -tp 4 "
                   "--kv-cache-dtype fp8", env)
    assert http(server.url + "/v1/models")[0] == 200


def test_old_flashinfer_refused(venv_root, tmp_path):
    old = make_venv(venv_root, "0.6.16")
    result = run_fail(f"vllm serve {FLASH} -tp 4", lab_env(tmp_path, old), old)
    assert result.returncode == 1
    assert "Sparse-MLA initialization error" in result.stderr
    assert "FlashInfer >= 0.6.18 required" in result.stderr


def test_flashinfer_split_faults_on_first_request(venv_root, tmp_path):
    split = make_venv(venv_root, "0.6.18", "0.6.16")
    env = lab_env(tmp_path, split)
    port = free_port()
    server = Server(f"vllm serve {FLASH} -tp 4 --port {port} --host 127.0.0.1", env, split,
                    tmp_path / "split.log", port).wait()
    try:
        status, _ = http(server.url + "/v1/chat/completions",
                         {"model": FLASH, "messages": READY, "max_tokens": 8})
        assert status == 500
        assert server.proc.wait(10) != 0
        assert "CUDA error: an illegal memory access was encountered" in server.log.read_text()
    finally:
        server.stop()


def test_health_waits_for_start_time(env, start):
    # Long enough that a loaded machine (every core running tests) still starts both
    # interpreters well inside it; the test polls rather than sleeping a guess.
    env = {**env, "GPUFLEET_LAB_START_SECONDS": "5"}
    vllm = start(f"vllm serve {FLASH} -tp 4 --port PORT --host 127.0.0.1", env, wait=False)
    sgl = start(f"python -m sglang.launch_server --model-path {GLM} --tp-size 8 --port PORT "
                "--host 127.0.0.1", env, wait=False)
    end = time.time() + 4
    while True:  # SGLang listens at once and answers 503 until it is ready
        try:
            status = http(sgl.url + "/health", timeout=1)[0]
            break
        except OSError:
            assert time.time() < end, "the SGLang stand-in never started listening"
            time.sleep(0.1)
    assert status == 503  # SGLang: listening, not ready
    with pytest.raises(OSError):
        urllib.request.urlopen(vllm.url + "/health", timeout=2)  # vLLM: not listening yet
    vllm.wait()
    sgl.wait()
    assert http(vllm.url + "/health") == (200, "")


# --- the API -------------------------------------------------------------------------
def test_vllm_chat_with_parsers(env, start):
    server = start(VLLM_FULL + " --api-key sk-lab", env)
    c = client(server, "sk-lab")
    low = c.chat.completions.create(model=FLASH, messages=READY, max_tokens=64, extra_body={
        "chat_template_kwargs": {"reasoning_effort": "low"}})
    assert low.choices[0].message.content == "READY"
    assert reasoning(low.choices[0].message)
    assert low.choices[0].finish_reason == "stop" and low.object == "chat.completion"
    assert low.usage.completion_tokens <= 64 and low.id.startswith("chatcmpl-")

    # effort max (the default) spends 64 tokens thinking: no content at all
    cut = c.chat.completions.create(model=FLASH, messages=READY, max_tokens=64)
    assert cut.choices[0].finish_reason == "length"
    assert cut.choices[0].message.content is None and reasoning(cut.choices[0].message)
    high = c.chat.completions.create(model=FLASH, messages=READY, extra_body={
        "chat_template_kwargs": {"reasoning_effort": "high"}})
    assert low.usage.completion_tokens < high.usage.completion_tokens < cut.usage.total_tokens + 200

    tool = c.chat.completions.create(model=FLASH, messages=ASK_WEATHER, tools=WEATHER)
    choice = tool.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris"}

    schema = {"type": "object", "properties": {"name": {"type": "string"}, "n": {
        "type": "integer"}, "ok": {"type": "boolean"}}, "required": ["name", "n", "ok"]}
    structured = c.chat.completions.create(model=FLASH, messages=READY[:0] + [
        {"role": "user", "content": "Describe a city"}], response_format={
        "type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    data = json.loads(structured.choices[0].message.content)
    assert isinstance(data["name"], str) and isinstance(data["n"], int) and data["ok"] is True

    # --api-key protects /v1 only
    assert http(server.url + "/v1/models")[0] == 401
    assert http(server.url + "/health")[0] == 200
    assert http(server.url + "/metrics")[0] == 200
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="other", messages=READY)


def test_vllm_streaming_completions_metrics(env, start):
    server = start(VLLM_FULL, env)
    c = client(server)
    chunks = list(c.chat.completions.create(
        model=FLASH, messages=READY, stream=True, stream_options={"include_usage": True},
        extra_body={"chat_template_kwargs": {"reasoning_effort": "low"}}))
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    thought = "".join((ch.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                      for ch in chunks if ch.choices)
    assert content == "READY" and thought.startswith("The user asks")
    assert chunks[-1].usage.completion_tokens > 1
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"

    text = c.completions.create(model=FLASH, prompt="The capital of France is", max_tokens=5)
    assert text.object == "text_completion" and text.choices[0].finish_reason == "length"
    assert text.usage.completion_tokens == 5
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=FLASH, prompt="Reply with exactly: OK", stream=True))
    assert streamed.strip() == "OK"

    models = c.models.list().data
    assert models[0].id == FLASH
    metrics = http(server.url + "/metrics")[1]
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:request_success_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket"):
        assert f"\n{name}{{" in metrics, name
    assert "vllm:gpu_cache_usage_perc" not in metrics  # gone in vLLM 0.33 (metrics.json)
    generated = [line for line in metrics.splitlines()
                 if line.startswith("vllm:generation_tokens_total")]
    assert float(generated[0].split()[-1]) > 5


def test_vllm_without_parsers_degrades(env, start):
    server = start(f"vllm serve {FLASH} --port PORT --host 127.0.0.1 -tp 4", env)
    c = client(server)
    reply = c.chat.completions.create(model=FLASH, messages=READY, extra_body={
        "chat_template_kwargs": {"reasoning_effort": "low"}})
    content = reply.choices[0].message.content
    assert content.startswith("The user asks") and content.endswith("</think>READY")
    assert reasoning(reply.choices[0].message) is None
    with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):
        c.chat.completions.create(model=FLASH, messages=ASK_WEATHER, tools=WEATHER)


def test_vllm_glm45_tool_parser_leaves_raw_text(env, start):
    server = start(f"vllm serve {FLASH} --port PORT --host 127.0.0.1 -tp 4 "
                   "--reasoning-parser glm45 --tool-call-parser glm45 "
                   "--enable-auto-tool-choice", env)
    reply = client(server).chat.completions.create(model=FLASH, messages=ASK_WEATHER,
                                                   tools=WEATHER)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content == ("<tool_call>get_weather<arg_key>city</arg_key>"
                                      "<arg_value>Paris</arg_value></tool_call>")


def test_images(env, start):
    flash = start(VLLM_FULL, env)
    text_only = start(f"python -m sglang.launch_server --model-path {GLM} --tp-size 8 "
                      "--port PORT --host 127.0.0.1", env)
    one = [{"role": "user", "content": [{"type": "text", "text": "What is in the image?"},
                                        {"type": "image_url", "image_url": {"url": PNG}}]}]
    reply = client(flash).chat.completions.create(model=FLASH, messages=one)
    assert "image" in reply.choices[0].message.content
    two = [{"role": "user", "content": one[0]["content"] + [
        {"type": "image_url", "image_url": {"url": PNG}}]}]
    with pytest.raises(openai.BadRequestError,
                       match=r"At most 1 image\(s\) may be provided in one prompt\."):
        client(flash).chat.completions.create(model=FLASH, messages=two)
    with pytest.raises(openai.BadRequestError, match="not a multimodal model"):
        client(text_only).chat.completions.create(model=GLM, messages=one)


def test_clear_thinking_drops_earlier_reasoning(env, start):
    server = start(VLLM_FULL, env)
    c = client(server)
    first = c.chat.completions.create(model=FLASH, messages=READY, extra_body={
        "chat_template_kwargs": {"reasoning_effort": "low"}})
    earlier = reasoning(first.choices[0].message)
    history = READY + [{"role": "assistant", "content": "READY", "reasoning_content": earlier},
                       {"role": "user", "content": "And again?"}]
    for clear in (False, True):
        c.chat.completions.create(model=FLASH, messages=history, extra_body={
            "chat_template_kwargs": {"clear_thinking": clear, "reasoning_effort": "low"}})
        prompt = json.loads(http(server.url + "/_lab/last_prompt")[1])["prompt"]
        assert (earlier in prompt) is not clear
        assert "Reasoning Effort: Low" in prompt


def test_sglang_api(env, start):
    server = start(SGLANG_FULL + " --api-key sk-lab", env)
    auth = {"Authorization": "Bearer sk-lab"}
    c = client(server, "sk-lab")
    tool = c.chat.completions.create(model="anything", messages=ASK_WEATHER, tools=WEATHER)
    assert tool.choices[0].finish_reason == "tool_calls"
    assert reasoning(tool.choices[0].message)
    assert http(server.url + "/health_generate")[0] == 200
    assert http(server.url + "/get_model_info")[0] == 401
    info = json.loads(http(server.url + "/get_model_info", headers=auth)[1])
    assert info["model_path"] == GLM and info["has_image_understanding"] is False
    server_info = json.loads(http(server.url + "/get_server_info", headers=auth)[1])
    assert server_info["version"] == "0.5.23" and server_info["tp_size"] == 8
    # typed as SGLang's ServerArgs (sglang-router reads typed fields from it)
    assert server_info["mem_fraction_static"] == 0.8
    status, body = http(server.url + "/v1/messages", {
        "model": "glm-5.3[1m]", "max_tokens": 256, "messages": READY,
        "chat_template_kwargs": {"reasoning_effort": "low"}}, auth)
    message = json.loads(body)
    assert status == 200 and message["type"] == "message"
    assert [b["type"] for b in message["content"]] == ["thinking", "text"]
    assert message["content"][1]["text"] == "READY" and message["stop_reason"] == "end_turn"
    metrics = http(server.url + "/metrics")[1]
    for name in ("sglang:num_running_reqs", "sglang:token_usage", "sglang:gen_throughput",
                 "sglang:prompt_tokens_total", "sglang:time_to_first_token_seconds_bucket"):
        assert f"\n{name}{{" in metrics, name


def test_sglang_without_tool_parser_and_metrics_flag(env, start):
    server = start(f"python -m sglang.launch_server --model-path {GLM} --tp-size 8 "
                   "--port PORT --host 127.0.0.1 --tool-call-parser glm45", env)
    reply = client(server).chat.completions.create(model=GLM, messages=ASK_WEATHER,
                                                   tools=WEATHER)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert "</think><tool_call>get_weather<arg_key>city</arg_key>" in choice.message.content
    assert http(server.url + "/metrics")[0] == 404  # SGLang needs --enable-metrics


def test_vllm_with_a_shutdown_timeout_drains_then_exits_on_sigterm(env, start):
    """vLLM's --shutdown-timeout: SIGTERM refuses new work and exits once nothing runs."""
    server = start(f"vllm serve {FLASH} -tp 4 --port PORT --host 127.0.0.1 "
                   "--shutdown-timeout 30", env)
    assert http(server.url + "/v1/completions", {"model": FLASH, "prompt": "hi",
                                                 "max_tokens": 4})[0] == 200
    t0 = time.monotonic()
    server.proc.terminate()
    assert server.proc.wait(10) == 0
    assert time.monotonic() - t0 < 5  # the request was done: no wait for the 30 s
    # (its count may still hold it: the reply goes out before the count drops)
    assert re.search(r"Shutdown requested: waiting up to 30 s for [01] request\(s\) in flight",
                     server.log.read_text())


def test_a_draining_vllm_fails_new_work_with_500_and_its_health_stays_200(env, start):
    """As real vLLM 0.32.0 does (tests/integration/test_real_vllm_cpu.py): while it drains,
    the request in flight finishes, a new one gets the engine client's error (500), and
    /health still answers 200 (a router's health check does not see the drain; the pools'
    rolling restart takes a worker out of the routers before it stops it)."""
    server = start(f"vllm serve {FLASH} -tp 4 --port PORT --host 127.0.0.1 "
                   "--shutdown-timeout 30", {**env, "GPUFLEET_LAB_STEP_MS": "300"})
    answer: dict = {}
    worker = threading.Thread(target=lambda: answer.update(done=http(
        server.url + "/v1/completions",
        {"model": FLASH, "prompt": "hi", "max_tokens": 40, "ignore_eos": True}, timeout=30)))
    worker.start()
    time.sleep(0.5)  # its answer's tokens at 300 ms each: in flight for seconds
    server.proc.terminate()
    time.sleep(0.3)
    assert http(server.url + "/health")[0] == 200
    status, text = http(server.url + "/v1/completions",
                        {"model": FLASH, "prompt": "x", "max_tokens": 1})
    assert status == 500 and json.loads(text)["error"] == {
        "message": "cannot schedule new futures after shutdown",
        "type": "InternalServerError", "param": None, "code": 500}, text
    worker.join(30)
    assert answer["done"][0] == 200, answer
    assert json.loads(answer["done"][1])["usage"]["completion_tokens"] > 3
    assert server.proc.wait(10) == 0


def test_a_paced_engine_runs_at_most_its_running_request_cap_at_once(env, start):
    """GPUFLEET_LAB_STEP_MS (the scale-out throughput benchmark): each request takes a
    step per generated token, and --max-running-requests bounds how many run together, so
    one worker's throughput has a ceiling that more workers raise."""
    server = start(SGLANG_FULL + " --max-running-requests 2",
                   {**env, "GPUFLEET_LAB_STEP_MS": "50"})
    c = client(server)

    def one(i: int) -> float:
        began = time.monotonic()
        c.chat.completions.create(model=GLM, max_tokens=8,
                                  messages=[{"role": "user", "content": f"hi {i}"}])
        return time.monotonic() - began

    began = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        each = list(pool.map(one, range(4)))
    took = time.monotonic() - began
    # 8 tokens x 50 ms = 0.4 s each; two at a time: 0.8 s for four, the later two waiting
    assert min(each) >= 0.4 and 0.8 <= took < 1.6, (each, took)


def test_a_compiled_graph_is_loaded_by_the_next_start_even_from_another_home(env, start,
                                                                              tmp_path, venv):
    """vLLM compiles into VLLM_CACHE_ROOT once; a second engine of the same configuration
    (another host on the shared cache: another HOME) loads it; another configuration
    compiles its own; --enforce-eager compiles nothing; a root it cannot create fails the
    start with Python's error (here a file in the way, which stops root too)."""
    cmd = f"vllm serve {FLASH} -tp 4 --port PORT --host 127.0.0.1"
    first = start(cmd, env)
    root = Path(env["VLLM_CACHE_ROOT"]) / "torch_compile_cache"
    (graph,) = root.glob("*/rank_0_0/gpufleet-lab-graph.json")
    assert json.loads(graph.read_text())["host"] == socket.gethostname()
    assert "Compiling a graph for dynamic shape" in first.log.read_text()
    second = start(cmd, {**env, "HOME": str(tmp_path / "elsewhere")})
    said = second.log.read_text()
    assert f"Using cache directory: {graph.parent}" in said
    assert "Directly load the compiled graph(s)" in said and "Compiling" not in said
    start(cmd + " --max-model-len 4096", env)
    assert len(list(root.glob("*/rank_0_0/gpufleet-lab-graph.json"))) == 2
    eager = start(cmd + " --enforce-eager", env)
    assert "torch.compile" not in eager.log.read_text()
    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("")
    refused = run_fail(cmd.replace("PORT", str(free_port())),
                       {**env, "VLLM_CACHE_ROOT": str(in_the_way / "vllm")}, venv)
    assert refused.returncode == 1, refused.stderr
    assert "NotADirectoryError: [Errno 20] Not a directory" in refused.stderr
