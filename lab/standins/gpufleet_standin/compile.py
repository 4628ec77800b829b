"""The engines' compile cache, as they use it at start-up.

vLLM (unless --enforce-eager) compiles the model's graphs with torch.compile into
$VLLM_CACHE_ROOT/torch_compile_cache/<hash>/rank_<tp>_<dp> (default ~/.cache/vllm), the hash
over its configuration and version; a directory that holds a compiled graph is loaded, not
compiled again. SGLang does the same with --enable-torch-compile under
$SGLANG_JIT_CACHE_ROOT/torch_compile/<hash> (default ~/.cache/sglang). A directory the
engine cannot create fails its start with Python's error (PermissionError,
NotADirectoryError, ...).

The stand-in compiles for GPUFLEET_LAB_COMPILE_SECONDS (default 1) and writes one artifact
naming the host that compiled it (the lab's test reads it from the shared cache); with it
present, it loads.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from pathlib import Path

from .settings import StartupError

ARTIFACT = "gpufleet-lab-graph.json"
# what the hash covers (the real engines: their config objects' compute_hash)
KEYED = ("", "--model", "--model-path", "--tensor-parallel-size", "--tp-size", "--dtype",
         "--quantization", "--kv-cache-dtype", "--max-model-len", "--context-length",
         "--compilation-config", "-O", "--speculative-config", "--speculative-algorithm")


def directory(s, version: str) -> Path | None:
    """Where the engine keeps this configuration's compiled graphs; None where it compiles
    nothing."""
    key = json.dumps([version, s.engine, {f: s.flags.get(f) for f in KEYED}], sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    home = Path(s.env.get("HOME") or Path.home())
    if s.engine == "vllm":
        if s.flags.get("--enforce-eager"):
            return None
        root = Path(s.env.get("VLLM_CACHE_ROOT") or home / ".cache" / "vllm")
        return root / "torch_compile_cache" / digest / "rank_0_0"
    if not s.flags.get("--enable-torch-compile"):
        return None
    root = Path(s.env.get("SGLANG_JIT_CACHE_ROOT") or home / ".cache" / "sglang")
    return root / "torch_compile" / digest


def load_or_compile(s, version: str, log) -> None:
    where = directory(s, version)
    if where is None:
        return
    if s.engine == "vllm":
        log("INFO", f"Using cache directory: {where} for vLLM's torch.compile")
    artifact = where / ARTIFACT
    started = time.monotonic()
    if artifact.is_file():
        log("INFO", "Directly load the compiled graph(s) for dynamic shape from the cache, "
            f"took {time.monotonic() - started + 0.1:.3f} s")
        return
    try:
        where.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StartupError(f"{type(exc).__name__}: [Errno {exc.errno}] {exc.strerror}: "
                           f"'{exc.filename}'") from exc
    time.sleep(float(s.env.get("GPUFLEET_LAB_COMPILE_SECONDS", "1")))
    tmp = where / f".{ARTIFACT}.{os.getpid()}"
    tmp.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                               "time": time.time()}))
    tmp.replace(artifact)
    log("INFO", f"Compiling a graph for dynamic shape takes {time.monotonic() - started:.2f} s")
