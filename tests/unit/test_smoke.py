"""The smoke test against the lab's stand-in engines on loopback.

The engines run with the planner's own argv (program path, port and host changed);
a flag taken out must make the smoke fail naming that flag.
"""

from __future__ import annotations

import json
import shlex
import socket
import struct
import time
import zlib

import pytest
import test_standins as base
from test_standins import FLASH, GLM

from gpufleet import smoke
from gpufleet.catalog import load
from gpufleet.plan import make_plan

GB200 = {"arch": "blackwell", "gpus": [{"index": i, "name": "NVIDIA GB200", "memory_mib": 190464}
                                       for i in range(4)]}
LIMIT = ["--limit-mm-per-prompt", '{"image":1}']


def plan_argv(target: str, venv, drop: tuple = (), add: tuple = ()) -> list[str]:
    """The planner's argv for the target's first process, runnable on loopback."""
    argv = list(make_plan(target).processes[0].argv)
    argv[0] = str(venv / "bin" / argv[0].rsplit("/", 1)[-1])
    for flag in drop:
        i = argv.index(flag)
        del argv[i: i + (1 if flag.startswith("--enable") else 2)]
    return argv + ["--host", "127.0.0.1", *add]


def image_limit_of(argv: list[str]) -> int | None:
    if "--limit-mm-per-prompt" not in argv:
        return None
    return json.loads(argv[argv.index("--limit-mm-per-prompt") + 1]).get("image")


def modalities(target: str) -> list[str]:
    catalog = load()
    return catalog.models[catalog.targets[target].model].modalities


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    root = tmp_path_factory.mktemp("smoke")
    venv = base.make_venv(tmp_path_factory.mktemp("standins-smoke"))
    servers = []

    def start(argv: list[str], hw=base.H200):
        port = base.free_port()
        i = argv.index("--port")
        argv = argv[: i + 1] + [str(port)] + argv[i + 2:]
        env = base.lab_env(root, venv, hw)
        server = base.Server(shlex.join(argv), env, venv, root / f"s{len(servers)}.log", port)
        servers.append(server)
        return server.wait()

    start.venv = venv
    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def flash(lab):
    """gb200-tray exactly as planned."""
    return lab(plan_argv("gb200-tray", lab.venv), GB200)


@pytest.fixture(scope="module")
def flash_unlimited(lab):
    """gb200-tray without the image limit the planner sets."""
    return lab(plan_argv("gb200-tray", lab.venv, drop=("--limit-mm-per-prompt",)), GB200)


@pytest.fixture(scope="module")
def flash_limited(lab):
    """gb200-tray plus the image limit and an API key."""
    return lab(plan_argv("gb200-tray", lab.venv, add=(*LIMIT, "--api-key", "sk-lab-secret")),
               GB200)


@pytest.fixture(scope="module")
def sglang(lab):
    return lab(plan_argv("sglang-h200-balanced", lab.venv))


def by_name(checks) -> dict:
    return {c.name: c for c in checks}


def failed(checks) -> dict:
    return {c.name: c for c in checks if not c.ok}


# --- whole deployments -----------------------------------------------------------------
def test_vllm_plan_argv_passes_every_check(flash, lab):
    argv = plan_argv("gb200-tray", lab.venv)
    checks = smoke.run_smoke(flash.url + "/v1", FLASH, "vllm",
                             multimodal="image" in modalities("gb200-tray"),
                             image_limit=image_limit_of(argv), timeout=20)
    assert [c.name for c in checks] == list(smoke.CHECKS)
    assert failed(checks) == {}, smoke.render_table(checks)
    got = by_name(checks)
    assert got["messages"].skipped and not got["clear_thinking"].skipped
    assert not got["image"].skipped and not got["reasoning"].skipped
    assert "reasoning_effort=low" in got["ready"].detail  # says what was sent
    assert "get_weather" in got["tool_call"].detail


def test_sglang_plan_argv_passes_with_messages(sglang):
    checks = smoke.run_smoke(sglang.url, GLM, "sglang",
                             multimodal="image" in modalities("sglang-h200-balanced"), timeout=20)
    assert failed(checks) == {}, smoke.render_table(checks)
    got = by_name(checks)
    assert not got["messages"].skipped and "'text'" in got["messages"].detail
    assert got["image"].skipped and "text-only" in got["image"].detail


# --- parsers -----------------------------------------------------------------------------
def test_missing_tool_call_parser_is_named(lab, capsys):
    argv = plan_argv("gb200-tray", lab.venv,
                     drop=("--tool-call-parser", "--enable-auto-tool-choice"))
    server = lab(argv, GB200)
    code = smoke.main(["--url", server.url + "/v1", "--model", FLASH, "--engine", "vllm",
                       "--multimodal", "--timeout", "20"])
    err = capsys.readouterr().err
    assert code == 1
    assert "tool_call failed" in err and "--tool-call-parser glm47" in err
    assert [line.split()[1] for line in err.splitlines()] == ["tool_call"]


def test_glm45_tool_parser_leaves_text(lab):
    argv = plan_argv("gb200-tray", lab.venv, drop=("--tool-call-parser",),
                     add=("--tool-call-parser", "glm45"))
    server = lab(argv, GB200)
    check, = smoke.run_smoke(server.url, FLASH, "vllm", only=["tool_call"], timeout=20)
    assert not check.ok
    assert check.detail.startswith("tool call came back as text: is --tool-call-parser glm47")


def test_missing_reasoning_parser_is_named(lab):
    server = lab(plan_argv("gb200-tray", lab.venv, drop=("--reasoning-parser",)), GB200)
    checks = smoke.run_smoke(server.url, FLASH, "vllm", timeout=20)
    bad = failed(checks)
    assert bad["reasoning"].detail.startswith(
        "reasoning mixed into content: is --reasoning-parser glm45 set?")
    assert set(bad) == {"reasoning", "json_schema", "clear_thinking"}
    assert all("--reasoning-parser glm45" in c.cause for c in bad.values())
    dynamo, = smoke.run_smoke(server.url, FLASH, "dynamo", only=["reasoning"], timeout=20)
    assert "--dyn-reasoning-parser glm45" in dynamo.detail


def test_reasoning_not_expected_is_skipped(flash):
    check, = smoke.run_smoke(flash.url, FLASH, "vllm", reasoning_parser=False,
                             only=["reasoning"])
    assert check.ok and check.skipped


# --- READY on a reasoning model ------------------------------------------------------------
def test_ready_truncated_during_reasoning(flash):
    check, = smoke.run_smoke(flash.url, FLASH, "vllm", only=["ready"], ready_max_tokens=8,
                             ready_effort="max", timeout=20)
    assert not check.ok
    assert check.detail.startswith("reasoning used all 8 tokens before answering")
    assert check.cause == "raise max_tokens or lower reasoning_effort"
    assert "no READY" not in check.detail
    # the seed's curl as is (no reasoning_effort: the template uses max) is cut too
    plain, = smoke.run_smoke(flash.url, FLASH, "vllm", only=["ready"], ready_effort=None)
    assert plain.detail.startswith("reasoning used all 64 tokens")
    assert "reasoning_effort" not in plain.detail


# --- images ----------------------------------------------------------------------------------
def test_one_image_and_the_limit(flash_limited):
    check, = smoke.run_smoke(flash_limited.url, FLASH, "vllm", api_key="sk-lab-secret",
                             multimodal=True, image_limit=1, only=["image"], timeout=20)
    assert check.ok and not check.skipped, check.detail
    assert "one image answered" in check.detail and "2 images refused (400)" in check.detail


def test_second_image_accepted_without_the_limit_flag(flash_unlimited):
    check, = smoke.run_smoke(flash_unlimited.url, FLASH, "vllm", multimodal=True, image_limit=1,
                             only=["image"], timeout=20)
    assert not check.ok
    assert check.detail == "second image accepted: set --limit-mm-per-prompt"


def test_text_only_model(sglang):
    check, = smoke.run_smoke(sglang.url, GLM, "sglang", multimodal=True, only=["image"],
                             timeout=20)
    assert not check.ok and "one image refused (400" in check.detail
    assert "not a multimodal model" in check.detail
    skipped, = smoke.run_smoke(sglang.url, GLM, "sglang", only=["image"])
    assert skipped.ok and skipped.skipped


def test_plan_limits_images_for_multimodal_models():
    for target in ("gb200-tray", "h200-agg"):
        argv = make_plan(target).processes[0].argv
        assert image_limit_of(argv) == 1, target


# --- clear_thinking --------------------------------------------------------------------------
def test_clear_thinking_detects_a_template_that_ignores_it(flash, monkeypatch):
    ok, = smoke.run_smoke(flash.url, FLASH, "vllm", only=["clear_thinking"], timeout=20)
    assert ok.ok and not ok.skipped, ok.detail
    chat = smoke.Smoke.chat

    def ignore_template(self, messages, *a, **kw):
        kw.pop("template", None)
        return chat(self, messages, *a, **kw)

    monkeypatch.setattr(smoke.Smoke, "chat", ignore_template)
    bad, = smoke.run_smoke(flash.url, FLASH, "vllm", only=["clear_thinking"], timeout=20)
    assert not bad.ok and "still carries turn 1's reasoning" in bad.detail


def test_clear_thinking_skipped_without_the_lab_route(flash, monkeypatch):
    monkeypatch.setattr(smoke.Smoke, "http", lambda self, method, path, body=None: (404, ""))
    check, = smoke.run_smoke(flash.url, FLASH, "vllm", only=["clear_thinking"])
    assert check.skipped and "not checkable on a real engine" in check.detail


# --- CLI, key, timeouts ----------------------------------------------------------------------
def test_cli_api_key_never_printed(flash_limited, tmp_path, capsys):
    key_file = tmp_path / "key"
    key_file.write_text("sk-lab-secret\n")
    args = ["--url", flash_limited.url + "/v1", "--model", FLASH, "--engine", "vllm",
            "--only", "models", "--only", "ready"]
    assert smoke.main(args + ["--api-key-file", str(key_file), "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["ok"] is True and "sk-lab-secret" not in out.out + out.err
    key_file.write_text("sk-wrong")
    assert smoke.main(args + ["--api-key-file", str(key_file)]) == 1
    out = capsys.readouterr()
    assert "models failed: 401 unauthorized -- likely cause: wrong or missing API key" in out.err
    assert "sk-wrong" not in out.out + out.err


def test_replicas_every_url_is_checked_and_a_bad_one_is_named(flash, capsys):
    dead = socket.socket()  # a port nothing answers on: connection refused
    dead.bind(("127.0.0.1", 0))
    bad = f"http://127.0.0.1:{dead.getsockname()[1]}/v1"
    dead.close()
    base = ["--model", FLASH, "--engine", "vllm", "--only", "models", "--only", "ready"]
    assert smoke.main(["--url", flash.url + "/v1", "--url", flash.url + "/v1/", *base,
                       "--json"]) == 0
    both = json.loads(capsys.readouterr().out)
    assert both["ok"] and [e["url"] for e in both["endpoints"]] == [flash.url + "/v1",
                                                                   flash.url + "/v1/"]
    assert [c["status"] for e in both["endpoints"] for c in e["checks"]] == ["ok"] * 4
    # --settle 3: the dead URL is waited for (refused connections are retried) 3 s, not 90
    assert smoke.main(["--url", flash.url + "/v1", "--url", bad, *base, "--settle", "3"]) == 1
    out = capsys.readouterr()
    assert f"{flash.url}/v1\n" in out.out and f"{bad}\n" in out.out
    assert f"smoke: {bad}: models failed" in out.err
    assert f"smoke: {flash.url}/v1: " not in out.err


def test_nothing_hangs_on_a_silent_server():
    with socket.socket() as silent:  # accepts connections (backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/v1"
        start = time.monotonic()
        checks = smoke.run_smoke(url, FLASH, "sglang", timeout=0.5,
                                 only=["models", "stream", "messages"])
        assert time.monotonic() - start < 10
    assert [c.ok for c in checks] == [False, False, False]
    assert checks[0].detail == "no answer within 0.5s"


def test_unreachable_endpoint_fails_fast():
    port = base.free_port()
    checks = smoke.run_smoke(f"http://127.0.0.1:{port}", FLASH, "vllm", timeout=5)
    assert not any(c.ok for c in checks)
    assert checks[0].detail.startswith(f"cannot connect to http://127.0.0.1:{port}/v1")
    assert all(c.detail == "not run: endpoint unreachable" for c in checks[1:])
    table = smoke.render_table(checks)
    assert table.splitlines()[1].startswith("models") and " FAIL " in table


def test_png_is_valid():
    data = smoke.png(8)
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    pos, chunks = 8, {}
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos: pos + 8])
        body = data[pos + 8: pos + 8 + n]
        assert struct.unpack(">I", data[pos + 8 + n: pos + 12 + n])[0] == zlib.crc32(kind + body)
        chunks[kind] = body
        pos += 12 + n
    assert struct.unpack(">II", chunks[b"IHDR"][:8]) == (8, 8)
    assert len(zlib.decompress(chunks[b"IDAT"])) == 8 * (1 + 8 * 3)
    assert list(chunks) == [b"IHDR", b"IDAT", b"IEND"]


def test_options_from_plan():
    plan = make_plan("gb200-tray").to_json()
    plan["model"].setdefault("modalities", modalities("gb200-tray"))
    opts = smoke.options_from_plan(plan)
    assert opts == {"base_url": "https://workers-1:8000/v1", "model": FLASH, "engine": "vllm",
                    "multimodal": True, "image_limit": 1, "anthropic": False,
                    "answers": True}
    # the lab's real engine: vLLM's API (its engine speaks vllm), a random-weight model
    lab = smoke.options_from_plan(make_plan("lab-cpu").to_json())
    assert (lab["engine"], lab["answers"], lab["multimodal"]) == ("vllm", False, False)
    with pytest.raises(ValueError, match="engine must be one of"):
        smoke.run_smoke("http://x/v1", FLASH, "tgi")


class _Settling:
    """An endpoint that answers 503 (a router with its worker's circuit open) `n` times."""

    def __init__(self, n: int):
        import http.server
        import threading
        outer = self
        self.n, self.seen = n, 0

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                self.rfile.read(int(self.headers["Content-Length"]))
                outer.seen += 1
                code = 503 if outer.seen <= outer.n else 200
                self.send_response(code)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"


@pytest.mark.parametrize("n, within, status", [(2, 30, 200), (1000, 3, 503), (0, 30, 200)])
def test_settle_waits_while_the_router_says_not_yet(n, within, status):
    end = _Settling(n)
    said = []
    s = smoke.Smoke(end.url, "m", "sglang", None, timeout=5)
    t0 = time.monotonic()
    try:
        assert smoke.settle(s, within, say=lambda *a, **k: said.append(a[0])) == status
    finally:
        end.server.shutdown()
    took = time.monotonic() - t0
    if n < 1000:
        assert end.seen == n + 1 and took < 2 * n + 2
    else:  # gives up at the deadline and says so; the checks then report the 503
        assert within <= took < within + 3 and "answers 503" in said[0]


def test_settle_rides_through_a_refused_connection():
    s = smoke.Smoke(f"http://127.0.0.1:{base.free_port()}/v1", "m", "vllm", None, timeout=1)
    t0 = time.monotonic()
    assert smoke.settle(s, 1, say=lambda *a, **k: None) is None
    assert time.monotonic() - t0 >= 1


def test_a_random_weight_model_skips_the_checks_that_read_an_answer(flash):
    """answers=False (the lab's real model): what a model of random weights cannot do is
    skipped with the reason; what it can is still checked (a stream's chunks and finish)."""
    checks = by_name(smoke.run_smoke(flash.url, FLASH, "vllm", answers=False, timeout=20))
    for name in ("ready", "reasoning", "tool_call", "json_schema", "clear_thinking"):
        assert checks[name].skipped and "random weights" in checks[name].detail, checks[name]
    for name in ("models", "stream", "completions"):
        assert checks[name].ok and not checks[name].skipped, checks[name]
    assert "answer not read" in checks["stream"].detail
    # the same server with answers read: READY is checked
    assert "READY" in by_name(smoke.run_smoke(flash.url, FLASH, "vllm", only=["stream"],
                                              timeout=20))["stream"].detail
