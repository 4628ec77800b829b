"""Entry points: `vllm serve ...` and `python -m sglang.launch_server ...`."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import uuid
from pathlib import Path

from . import compile as compile_cache
from . import engine_flags
from .cli import argparse_words
from .pd import Bootstrap, Nixl
from .server import Engine, serve
from .settings import DATA, StartupError, parse
from .startup import run_checks


def _log(level: str, text: str) -> None:
    print(f"{level} {time.strftime('%m-%d %H:%M:%S')} [lab-standin] {text}", file=sys.stderr,
          flush=True)


def _usage_error(engine: str, problems: list[str]) -> int:
    spec = DATA["engines"][engine]
    print(spec["usage"], file=sys.stderr)
    print(f"{spec['prog']}: error: {argparse_words(problems[0].split(': ', 1)[-1])}",
          file=sys.stderr)
    return 2


def _help(engine: str) -> int:
    spec = DATA["engines"][engine]
    print(spec["usage"])
    print("\noptions:")
    for flag, opt in engine_flags.table(spec["program"]).items():
        choices = opt.get("choices")
        print(f"  {flag}" + (f" {{{','.join(choices)}}}" if choices else ""))
    return 0


def _fail(engine: str, message: str) -> int:
    where = "EngineCore failed to start." if engine == "vllm" else "Scheduler hit an exception:"
    _log("ERROR", f"{where}\nTraceback (most recent call last):\n  File \"<lab stand-in>\", "
         f"line 1, in <module>\n{message}")
    if engine == "vllm":
        print("RuntimeError: Engine core initialization failed. See root cause above. Failed "
              "core proc(s): {}", file=sys.stderr, flush=True)
    return 1


def _ib_present(hw: dict, settings) -> bool:
    if settings.get("--disaggregation-ib-device"):
        return True
    ib = hw.get("ib")
    if isinstance(ib, dict):
        return int(ib.get("count") or 0) > 0 and ib.get("port_state", "Active") == "Active"
    if isinstance(ib, list):
        return bool(ib)
    sysfs = Path(settings.env.get("GPUFLEET_LAB_IB_SYSFS", "/sys/class/infiniband"))
    return sysfs.is_dir() and any(sysfs.iterdir())


def _setup_pd(engine: Engine) -> None:
    s, facts = engine.s, engine.facts
    if s.engine == "vllm":
        cfg = s.kv_transfer or {}
        if cfg.get("kv_connector") != "NixlConnector":
            if cfg:
                _log("WARNING", f"kv connector {cfg.get('kv_connector')} is not simulated")
            return
        engine.compat = {
            "vllm_version": engine.version, "connector": "NixlConnector",
            "model": s.model, "dtype": s.get("--dtype"), "kv_cache_dtype": s.kv_cache_dtype,
            "VLLM_SSM_CONV_STATE_LAYOUT": s.env.get("VLLM_SSM_CONV_STATE_LAYOUT"),
            "VLLM_KV_CACHE_LAYOUT": s.env.get("VLLM_KV_CACHE_LAYOUT"),
            "speculative_config": s.speculative, "tensor_parallel_size": s.tp}
        host = s.env.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "localhost")
        port = int(s.env.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600"))
        engine.nixl = Nixl(str(uuid.uuid4()), engine.compat, host, port, engine.log)
        try:
            engine.nixl.listen()
        except OSError as exc:
            raise StartupError(f"zmq.error.ZMQError: {exc.strerror or exc} "
                               f"(addr='tcp://{host}:{port}')") from exc
        _log("INFO", f"NIXL side channel listening on {host}:{port} (kv_role="
             f"{cfg.get('kv_role')}, engine_id={engine.nixl.engine_id})")
        return
    mode = s.pd_mode
    if not mode:
        return
    kv = s.kv_cache_dtype
    if kv == "auto" and facts["entry"].get("attention") == "dsa":
        kv = "fp8_e4m3" if facts["arch"] == "blackwell" else "bf16"
    backend = s.get("--disaggregation-transfer-backend")
    engine.compat = {
        "sglang_version": engine.version, "model": s.model, "dtype": s.get("--dtype"),
        "kv_cache_dtype": kv, "transfer_backend": backend, "page_size": s.get("--page-size"),
        "speculative": s.speculative}
    if backend == "mooncake" and not _ib_present(facts["hw"], s):
        _log("WARNING", "Mooncake: no RDMA device found (no InfiniBand HCA detected); "
             "falling back to TCP transport. Set --disaggregation-ib-device to use RDMA.")
    if mode == "prefill":
        port = int(s.get("--disaggregation-bootstrap-port"))
        timeout = float(s.env.get("GPUFLEET_LAB_KV_TIMEOUT", "30"))
        engine.bootstrap = Bootstrap(engine.compat, port, timeout)
        try:
            engine.bootstrap.listen("0.0.0.0")
        except OSError as exc:
            raise StartupError(f"OSError: [Errno {exc.errno}] error while attempting to bind "
                               f"on address ('0.0.0.0', {port}): {exc.strerror}") from exc
        _log("INFO", f"bootstrap server started on 0.0.0.0:{port}")


def _stop(engine) -> None:
    """SIGTERM. vLLM with --shutdown-timeout N > 0 fails new requests (500; /health still
    answers 200, as real vLLM's does) and exits once those in flight are done, or after
    N s; else (vLLM's default 0, SGLang) it exits at once, aborting them."""
    grace = float(engine.s.get("--shutdown-timeout") or 0) if engine and engine.vllm else 0
    if grace <= 0:
        sys.exit(0)
    engine.draining = True
    _log("INFO", f"Shutdown requested: waiting up to {grace:g} s for "
         f"{engine.metrics.running} request(s) in flight")

    def finish() -> None:
        end = time.monotonic() + grace
        while engine.metrics.running and time.monotonic() < end:
            time.sleep(0.05)
        os._exit(0)

    threading.Thread(target=finish, daemon=True).start()


def run(engine_name: str, args: list[str], version: str) -> int:
    if "-h" in args or "--help" in args:
        return _help(engine_name)
    settings, problems = parse(engine_name, args, version)
    if problems:
        return _usage_error(engine_name, problems)
    running: dict = {}
    signal.signal(signal.SIGTERM, lambda *_: _stop(running.get("engine")))
    label = "vLLM API server version" if engine_name == "vllm" else "SGLang version"
    _log("INFO", f"{label} {version} (gpufleet lab stand-in)")
    _log("INFO", f"non-default args: {json.dumps({k: v for k, v in settings.flags.items()})}")
    try:
        facts = run_checks(settings)
        compile_cache.load_or_compile(settings, version, _log)
        engine = Engine(settings, facts, version)
        running["engine"] = engine
        _setup_pd(engine)
        server = None
        if engine_name == "sglang":  # SGLang answers /health with 503 while loading
            server = serve(engine)
            threading.Thread(target=server.serve_forever, daemon=True).start()
        time.sleep(float(os.environ.get("GPUFLEET_LAB_START_SECONDS", "2")))
        if server is None:
            server = serve(engine)
    except StartupError as exc:
        return _fail(engine_name, exc.args[0])
    except OSError as exc:
        return _fail(engine_name, f"OSError: [Errno {exc.errno}] error while attempting to "
                     f"bind on address ({settings.host!r}, {settings.port}): {exc.strerror}")
    engine.ready = True
    url = f"http://{settings.host}:{settings.port}"
    if engine_name == "vllm":
        _log("INFO", f"Starting vLLM API server 0 on {url}")
        _log("INFO", "Application startup complete.")
        server.serve_forever()
    else:
        _log("INFO", f"Uvicorn running on {url} (Press CTRL+C to quit)")
        _log("INFO", "The server is fired up and ready to roll!")
        threading.Event().wait()
    return 0


def vllm_cli(argv: list[str], version: str) -> int:
    """`vllm ...` console script."""
    if argv[:1] in (["--version"], ["-v"]):
        print(version)
        return 0
    if not argv or argv[0] != "serve":
        print("usage: vllm [-h] [-v] {chat,complete,serve,bench,collect-env,run-batch} ...",
              file=sys.stderr)
        print("vllm: error: the lab stand-in only implements `vllm serve`", file=sys.stderr)
        return 2
    return run("vllm", argv[1:], version)


def vllm_api_server(argv: list[str], version: str) -> int:
    """`python -m vllm.entrypoints.openai.api_server --model M ...`."""
    return run("vllm", argv, version)


def sglang_launch(argv: list[str], version: str) -> int:
    return run("sglang", argv, version)


def sglang_cli(argv: list[str], version: str) -> int:
    """`sglang serve ...` console script."""
    if argv[:1] == ["version"] or argv[:1] == ["--version"]:
        print(version)
        return 0
    if not argv or argv[0] != "serve":
        print("usage: sglang {serve,version} ...", file=sys.stderr)
        return 2
    return run("sglang", argv[1:], version)
