"""Dynamo 1.6.1 in the lab: the real frontend, the lab's ``dynamo.vllm`` worker.

The session fixture downloads the pinned wheels once (lab/dynamo/fetch_wheels.sh),
builds the lab's ai-dynamo wheel (build.py) and installs both into a venv cached under
/var/cache/gpufleet-lab/dynamo/ keyed by the hash of every input, the way a lab host
installs from the lab's wheel source (``pip install --no-index --find-links``).
The checkpoint is the lab's HF mirror's zai-org/GLM-5.3-Flash (its real tokenizer and
chat template), and the served deployments must pass gpufleet's smoke test through the
frontend's own reasoning and tool-call parsers. Everything listens on 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LAB = REPO / "lab" / "dynamo"
sys.path.insert(0, str(LAB))
import build  # noqa: E402

sys.path.insert(0, str(LAB / "shim"))
import bpe  # noqa: E402

CACHE = Path(os.environ.get("GPUFLEET_LAB_CACHE", "/var/cache/gpufleet-lab")) / "dynamo"
MODEL = "zai-org/GLM-5.3-Flash"
# Keep every Dynamo socket on loopback (the default is the first non-loopback address).
LOOPBACK = {
    "DYN_TCP_RPC_HOST": "127.0.0.1",
    "DYN_EVENT_PLANE_HOST": "127.0.0.1",
    "DYN_SYSTEM_HOST": "127.0.0.1",
    "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
}


def _digest(*paths: Path) -> str:
    h = hashlib.sha256()
    for path in paths:
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


@contextlib.contextmanager
def _cache_lock():
    """CACHE to this process alone: the unit tests run in several processes at once."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="session")
def lab_wheels() -> Path:
    """The lab's wheel source for Dynamo: the pinned wheels (fetched once) + the lab build."""
    with _cache_lock():
        return _lab_wheels()


def _lab_wheels() -> Path:
    wheels = CACHE / f"wheels-{_digest(LAB / 'requirements.txt')}"
    if not (wheels / build.UPSTREAM).is_file():
        tmp = wheels.with_name(wheels.name + f".tmp{os.getpid()}")
        subprocess.run(["bash", str(LAB / "fetch_wheels.sh"), str(tmp)], check=True)
        shutil.rmtree(wheels, ignore_errors=True)
        tmp.rename(wheels)
    build.build(wheels / build.UPSTREAM, wheels)
    return wheels


@pytest.fixture(scope="session")
def lab_python(lab_wheels) -> Path:
    """python of a venv installed from the lab's wheel source, as a lab host does."""
    with _cache_lock():
        return _lab_python(lab_wheels)


def _lab_python(wheels: Path) -> Path:
    lab_wheel = wheels / build.OUTPUT
    venv = CACHE / f"venv-{_digest(LAB / 'requirements.txt', lab_wheel)}"
    if not (venv / "ok").exists():
        tmp = venv.with_name(venv.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(tmp)], check=True)
        pip = [str(tmp / "bin" / "python"), "-m", "pip", "install", "-q", "--no-index"]
        pip += ["--find-links", str(wheels), "-r", str(LAB / "requirements.txt")]
        subprocess.run(pip, check=True, env={**os.environ, "PIP_CONFIG_FILE": os.devnull})
        (tmp / "ok").touch()
        shutil.rmtree(venv, ignore_errors=True)
        tmp.rename(venv)  # the venv's python is a symlink; nothing else is path-bound
        for stale in CACHE.glob("venv-*"):  # about 350 MB each
            if stale != venv and ".tmp" not in stale.name:
                shutil.rmtree(stale, ignore_errors=True)
    return venv / "bin" / "python"


@pytest.fixture(scope="session")
def hf_cache(tmp_path_factory) -> Path:
    """An HF hub cache holding MODEL@main, downloaded from the lab's mirror."""
    from huggingface_hub import snapshot_download

    from gpufleet_lab.hfmirror import MirrorServer

    cache = tmp_path_factory.mktemp("hub")
    with MirrorServer(port=0, log_stream=io.StringIO()) as mirror:
        snapshot_download(MODEL, cache_dir=cache, endpoint=mirror.url,
                          allow_patterns=["*.json", "*.md"])  # fmt: skip
    return cache


def snapshot(hf_cache: Path) -> Path:
    repo = hf_cache / ("models--" + MODEL.replace("/", "--"))
    return repo / "snapshots" / (repo / "refs" / "main").read_text().strip()


@pytest.fixture()
def hw(tmp_path) -> Path:
    """A simulated 8-GPU Hopper host (the shape of /etc/gpufleet-lab/hw.json)."""
    gpus = [{"index": i, "uuid": f"GPU-{i:08x}"} for i in range(8)]
    path = tmp_path / "hw.json"
    path.write_text(json.dumps({"gpu": {"architecture": "Hopper"}, "gpus": gpus}))
    return path


def worker_argv(*extra: str) -> list[str]:
    """The plan's worker command line (H200 seed), as the unit runs it."""
    return [
        "-m", "dynamo.vllm",
        "--model", MODEL, "--served-model-name", MODEL,
        "--tensor-parallel-size", "8",
        "--kv-transfer-config", '{"kv_connector":"NixlConnector","kv_role":"kv_both"}',
        "--speculative-config", '{"method":"mtp","num_speculative_tokens":7}',
        "--dyn-tool-call-parser", "glm47", "--dyn-reasoning-parser", "glm45",
        "--enable-prefix-caching", "--max-model-len", "1048576",
        "--limit-mm-per-prompt", '{"image":1}',
        *extra,
    ]  # fmt: skip


def worker_env(hf_cache: Path, hw: Path, **extra: str) -> dict:
    env = {**os.environ, **LOOPBACK, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hf_cache)}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.update(GPUFLEET_LAB_HW=str(hw), GPUFLEET_LAB_SPEEDUP="10", **extra)
    return env


def dry_run(python: Path, argv: list[str], env: dict) -> subprocess.CompletedProcess:
    env = {**env, "GPUFLEET_LAB_SHIM_DRY_RUN": "1"}
    return subprocess.run([str(python), *argv], env=env, capture_output=True, text=True)


def free_port() -> int:
    """A free loopback port below 32768: Dynamo 1.6.1 parses DYN_SYSTEM_PORT as an i16."""
    while True:
        port = random.randint(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


class Procs:
    """Background processes with logs; all killed (by process group) at teardown."""

    def __init__(self, logdir: Path):
        self.logdir, self.procs = logdir, []

    def start(self, name: str, argv: list[str], env: dict) -> subprocess.Popen:
        log = open(self.logdir / f"{name}.log", "w")  # noqa: SIM115
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        self.procs.append((name, proc))
        return proc

    def logs(self) -> str:
        return "\n".join(
            f"--- {name}\n" + (self.logdir / f"{name}.log").read_text()[-3000:]
            for name, _ in self.procs
        )

    def stop(self) -> None:
        for _, proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for _, proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture()
def procs(tmp_path):
    p = Procs(tmp_path)
    yield p
    p.stop()


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:
        return 0, str(e)


def wait_for(what: str, check, procs: Procs, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        dead = [n for n, p in procs.procs if p.poll() is not None]
        assert not dead, f"{dead} exited while waiting for {what}\n{procs.logs()}"
        time.sleep(0.5)
    pytest.fail(f"timed out waiting for {what}\n{procs.logs()}")


def frontend(python: Path, port: int, *extra: str) -> list[str]:
    return [str(python), "-m", "dynamo.frontend", "--http-host", "127.0.0.1",
            "--http-port", str(port), *extra]  # fmt: skip


SMOKE_PASS = ("models", "ready", "stream", "completions", "reasoning", "tool_call",
              "json_schema")  # fmt: skip


def smoke(port: int, **options) -> dict:
    """{check name: Check} of gpufleet's smoke test against the frontend."""
    from gpufleet.smoke import run_smoke

    options = {"multimodal": False, "timeout": 30, **options}
    return {c.name: c for c in run_smoke(f"http://127.0.0.1:{port}", MODEL, "dynamo", **options)}


def assert_smoke_passes(port: int, procs: Procs) -> None:
    from gpufleet.smoke import render_table

    checks = smoke(port)
    failed = [n for n in SMOKE_PASS if not checks[n].ok or checks[n].skipped]
    assert not failed, f"{failed}\n{render_table(list(checks.values()))}\n{procs.logs()}"
    # one image answered, a second refused (--limit-mm-per-prompt), as the plan promises
    image = smoke(port, multimodal=True, image_limit=1, only=["image"])["image"]
    assert image.ok and "2 images refused (400)" in image.detail, image


# --- the wheel -------------------------------------------------------------------------


def test_lab_wheel_swaps_only_dynamo_vllm(lab_wheels, lab_python, tmp_path):
    import zipfile

    wheels = lab_wheels
    first = build.build(wheels / build.UPSTREAM, tmp_path / "a").read_bytes()
    second = build.build(wheels / build.UPSTREAM, tmp_path / "b").read_bytes()
    assert first == second, "the lab build must be reproducible"
    with zipfile.ZipFile(tmp_path / "a" / build.OUTPUT) as z:
        names = set(z.namelist())
        meta = z.read(f"{build.DIST_INFO}/METADATA").decode()
    assert "dynamo/vllm/main.py" not in names and "dynamo/vllm/lab.py" in names
    assert "dynamo/mocker/main.py" in names and "dynamo/frontend/main.py" in names
    requires = [line for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    assert not [r for r in requires if "aisimulate" in r or "transformers" in r]
    assert "Requires-Dist: ai-dynamo-runtime==1.6.1" in requires
    assert "\nVersion: 1.6.1\n" in meta
    out = subprocess.run(
        [str(lab_python), "-c", "import importlib.metadata as m, dynamo.vllm as v;"
         "print(m.version('ai-dynamo'), v.LAB_BUILD)"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert out.stdout.split() == ["1.6.1", "True"]


# --- the shim's refusals and translation -----------------------------------------------


def test_shim_rejects_unknown_flag(lab_python, hf_cache, hw):
    res = dry_run(lab_python, worker_argv("--no-such-flag"), worker_env(hf_cache, hw))
    assert res.returncode == 2, res
    assert "error: unknown flag --no-such-flag" in res.stderr
    res = dry_run(lab_python, worker_argv("--disaggregation-mode", "both"),
                  worker_env(hf_cache, hw))  # fmt: skip
    assert res.returncode == 2 and "'both' is not one of" in res.stderr


def test_shim_refuses_tp_above_visible_gpus(lab_python, hf_cache, hw):
    env = worker_env(hf_cache, hw, CUDA_VISIBLE_DEVICES="0,1,2,3")
    res = dry_run(lab_python, worker_argv(), env)
    assert res.returncode == 1
    assert "World size (8) is larger than the number of available GPUs (4)" in res.stderr
    res = dry_run(lab_python, worker_argv("--tensor-parallel-size", "4"), env)
    assert res.returncode == 0, res.stderr
    hw.write_text(json.dumps({"gpus": []}))  # a host without GPUs
    res = dry_run(lab_python, worker_argv("--tensor-parallel-size", "1"), worker_env(hf_cache, hw))
    assert res.returncode == 1 and "available GPUs (0)" in res.stderr


def test_shim_refuses_missing_checkpoint_offline(lab_python, tmp_path, hw):
    res = dry_run(lab_python, worker_argv(), worker_env(tmp_path / "empty", hw))
    assert res.returncode == 1
    assert "not in the Hugging Face cache" in res.stderr and "HF_HUB_OFFLINE=1" in res.stderr


def test_shim_refuses_fp8_kv_on_hopper(lab_python, hf_cache, hw):
    res = dry_run(lab_python, worker_argv("--kv-cache-dtype", "fp8"), worker_env(hf_cache, hw))
    assert res.returncode == 1 and "kv_cache_dtype=fp8" in res.stderr


def test_shim_translates_prefill_worker(lab_python, hf_cache, hw):
    env = worker_env(hf_cache, hw, VLLM_NIXL_SIDE_CHANNEL_HOST="10.0.0.5",
                     VLLM_NIXL_SIDE_CHANNEL_PORT="5601")  # fmt: skip
    argv = worker_argv("--disaggregation-mode", "prefill", "--discovery-backend", "etcd",
                       "--namespace", "glm")  # fmt: skip
    res = dry_run(lab_python, argv, env)
    assert res.returncode == 0, res.stderr
    worker = json.loads(res.stdout)["worker"]
    expected = {
        "model_path": str(snapshot(hf_cache)),
        "served": MODEL,
        "namespace": "glm",
        "component": "prefill",
        "endpoint": "generate",
        "mode": "prefill",
        "discovery_backend": "etcd",
        "event_plane": "zmq",
        "tool_call_parser": "glm47",
        "reasoning_parser": "glm45",
        "max_model_len": 1048576,
        "decode_speedup": 3.141,
        "side_channel": {"host": "10.0.0.5", "port": 5601},
    }
    assert {k: worker.get(k) for k in expected} == expected
    res = dry_run(lab_python, worker_argv("--disaggregation-mode", "decode"), env)
    worker = json.loads(res.stdout)["worker"]
    assert (worker["component"], worker["mode"], worker.get("side_channel")) == (
        "backend", "decode", None)  # fmt: skip


def test_lab_tokenizer_round_trips_glm_markers(hf_cache):
    """The checkpoint's tokenizer spells the stand-in's answers and the GLM markers."""
    tok = bpe.Tokenizer.from_dir(snapshot(hf_cache))
    text = (
        "The user asks: what's_up? 15% of 240 is 36.</think>READY<tool_call>get_weather"
        '<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>\n{"a": 1} é'
    )
    for specials in (True, False):
        assert tok.decode(tok.encode(text, specials=specials)) == text
    think = tok.token_id("</think>")
    assert think is not None and think in tok.encode(text)
    assert think not in tok.encode(text, specials=False)


# --- serving through the real frontend --------------------------------------------------


def serve_agg(lab_python, hf_cache, hw, procs, tmp_path, argv: list[str]) -> int:
    http, system = free_port(), free_port()
    env = worker_env(hf_cache, hw, DYN_FILE_KV=str(tmp_path / "kv"))
    procs.start("worker", [str(lab_python), *argv, "--discovery-backend", "file"],
                {**env, "DYN_SYSTEM_PORT": str(system)})  # fmt: skip
    procs.start("frontend", frontend(lab_python, http, "--router-mode", "round-robin",
                                     "--discovery-backend", "file"), env)  # fmt: skip
    wait_for("/v1/models", lambda: MODEL in get(f"http://127.0.0.1:{http}/v1/models")[1], procs)
    wait_for("worker /health", lambda: get(f"http://127.0.0.1:{system}/health")[0] == 200, procs)
    assert get(f"http://127.0.0.1:{http}/health")[0] == 200
    return http


def test_agg_file_discovery_passes_smoke(lab_python, hf_cache, hw, procs, tmp_path):
    http = serve_agg(lab_python, hf_cache, hw, procs, tmp_path, worker_argv())
    assert_smoke_passes(http, procs)
    checks = smoke(http)
    assert "get_weather" in checks["tool_call"].detail
    assert "words of reasoning" in checks["reasoning"].detail


def test_agg_without_tool_call_parser_fails_tool_call(lab_python, hf_cache, hw, procs, tmp_path):
    argv = worker_argv()
    i = argv.index("--dyn-tool-call-parser")
    del argv[i : i + 2]
    http = serve_agg(lab_python, hf_cache, hw, procs, tmp_path, argv)
    checks = smoke(http)
    tool = checks["tool_call"]
    assert not tool.ok and "--dyn-tool-call-parser glm47" in tool.cause, tool
    assert "came back as text" in tool.detail, tool
    assert checks["reasoning"].ok and checks["ready"].ok


def test_disagg_etcd_passes_smoke(lab_python, hf_cache, hw, procs, tmp_path):
    if not shutil.which("etcd"):
        pytest.fail("etcd is not installed. Fix: scripts/setup (apt-get install etcd-server)")
    client, peer, http = free_port(), free_port(), free_port()
    etcd_url = f"http://127.0.0.1:{client}"
    procs.start("etcd", ["etcd", "--name", "lab", "--data-dir", str(tmp_path / "etcd"),
                         "--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url,
                         "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                         "--initial-cluster", f"lab=http://127.0.0.1:{peer}"],
                os.environ.copy())  # fmt: skip
    wait_for("etcd", lambda: get(f"{etcd_url}/health")[0] == 200, procs, timeout=30)
    env = worker_env(hf_cache, hw, ETCD_ENDPOINTS=etcd_url)
    ports = {}
    for mode, gpus in (("prefill", "0,1,2,3"), ("decode", "4,5,6,7")):
        ports[mode] = free_port()
        procs.start(mode, [str(lab_python), *worker_argv(
            "--tensor-parallel-size", "4", "--disaggregation-mode", mode,
            "--discovery-backend", "etcd")],
            {**env, "CUDA_VISIBLE_DEVICES": gpus, "DYN_SYSTEM_PORT": str(ports[mode]),
             "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
             "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())})  # fmt: skip
    procs.start("frontend", frontend(lab_python, http, "--router-mode", "kv",
                                     "--discovery-backend", "etcd"), env)  # fmt: skip
    ready = f"http://127.0.0.1:{http}/v1/models/{MODEL}/ready"
    wait_for("prefill + decode", lambda: get(ready)[0] == 200, procs)
    assert json.loads(get(ready)[1])["ready"] is True
    assert_smoke_passes(http, procs)
    for mode, component in (("prefill", "prefill"), ("decode", "backend")):
        assert get(f"http://127.0.0.1:{ports[mode]}/health")[0] == 200
        metrics = get(f"http://127.0.0.1:{ports[mode]}/metrics")[1]
        served = [
            line for line in metrics.splitlines()
            if line.startswith("dynamo_component_requests_total{")
            and f'dynamo_component="{component}"' in line
            and 'dynamo_endpoint="generate"' in line
        ]  # fmt: skip
        assert served and float(served[0].rsplit(" ", 1)[1]) >= 6, (mode, metrics[-2000:])
    # each decode request first met its prefill worker on the NIXL side channel
    assert "NIXL side channel: handshake from" in (tmp_path / "prefill.log").read_text()
