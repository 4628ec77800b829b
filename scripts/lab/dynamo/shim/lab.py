"""``python -m dynamo.vllm`` in the lab: check the real worker's argv, then run the mocker.

1. The argv is checked against the option tables of Dynamo 1.6.1's vLLM worker plus
   vLLM 0.33.0 (``engine_flags.py``, the same checker the planner uses): an unknown
   flag, a bad choice or broken JSON exits 2 with an argparse-style message.
2. Misconfigurations a real worker refuses at startup are refused here too: tensor x
   pipeline (x local data) parallel size larger than the GPUs this process can see
   (``/etc/gpufleet-lab/hw.json`` ``gpus``, or ``$GPUFLEET_LAB_HW``, filtered by
   ``CUDA_VISIBLE_DEVICES``), FP8 KV cache for GLM-5.3-Flash on Hopper, and a
   checkpoint missing from the Hugging Face cache while ``HF_HUB_OFFLINE=1``.
3. It then execs ``python -m dynamo.mocker`` with the equivalent arguments: model path =
   the snapshot directory in the HF cache, model name = the served name, the same
   disaggregation mode, discovery/request/event planes, namespace and scheduler limits.

With ``--kv-transfer-config`` a prefill worker's NIXL side channel
(``VLLM_NIXL_SIDE_CHANNEL_HOST``/``_PORT``, vLLM's defaults localhost/5600) becomes the
mocker's bootstrap endpoint, which the decode worker connects to.

``GPUFLEET_LAB_SHIM_DRY_RUN=1`` prints ``{"argv": [...], "env": {...}}`` instead of running.
``GPUFLEET_LAB_SPEEDUP`` is the mocker's ``--speedup-ratio`` (default 1: real-ish timing).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from .engine_flags import check

PROG = "__main__.py"  # what the real worker's argparse prints
DEFAULT_MODEL = "Qwen/Qwen3-0.6B"  # vLLM's default --model
HW_FILE = "/etc/gpufleet-lab/hw.json"
# The mocker's --kv-cache-dtype choices; vLLM spellings it lacks are mapped or dropped.
MOCKER_KV_DTYPES = {"auto", "bfloat16", "fp8", "fp8_ds_mla", "fp8_e4m3", "fp8_e5m2", "fp8_inc"}
# Tokens per decode step a draft model of k tokens gives at this per-token acceptance.
MTP_ACCEPTANCE = 0.7


class Refused(Exception):
    """A startup refusal: (exit code, message)."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, add_help=False, allow_abbrev=False)
    a = p.add_argument
    a("--model", default=DEFAULT_MODEL)
    a("--served-model-name", nargs="+")
    a("--revision")
    a("--download-dir")
    a("--tensor-parallel-size", "-tp", type=int, default=1)
    a("--pipeline-parallel-size", "-pp", type=int, default=1)
    a("--data-parallel-size", "-dp", type=int, default=1)
    a("--data-parallel-size-local", "-dpl", type=int)
    a("--disaggregation-mode")
    a("--namespace", default=os.environ.get("DYN_NAMESPACE", "dynamo"))
    a("--endpoint", default=os.environ.get("DYN_ENDPOINT"))
    for flag in ("--discovery-backend", "--request-plane", "--response-plane", "--event-plane"):
        a(flag)
    for flag in ("--block-size", "--max-num-seqs", "--max-num-batched-tokens"):
        a(flag, type=int)
    a("--max-model-len")
    a("--gpu-memory-utilization", type=float)
    a("--kv-cache-dtype")
    a("--speculative-config")
    a("--kv-transfer-config")
    a("--enable-prefix-caching", dest="prefix_caching", action="store_true", default=None)
    a("--disable-prefix-caching", dest="prefix_caching", action="store_false")
    a("--enable-chunked-prefill", dest="chunked_prefill", action="store_true", default=None)
    a("--disable-chunked-prefill", dest="chunked_prefill", action="store_false")
    return p


def _usage_error(message: str) -> Refused:
    return Refused(2, f"usage: {PROG} [-h] [options]\n{PROG}: error: {message}")


def human_int(text: str) -> int | None:
    """vLLM's human-readable ints: 1048576, 1k (1000), 1K (1024), 1m, 1M, -1."""
    m = re.fullmatch(r"(-?\d+(?:\.\d+)?)([kKmMgG]?)", text.strip())
    if not m:
        return None
    number, suffix = float(m.group(1)), m.group(2)
    scale = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}
    return int(number * scale.get(suffix, 1))


def visible_gpus(env: dict) -> list[dict]:
    """The GPUs of the simulated host that CUDA_VISIBLE_DEVICES leaves visible."""
    path = Path(env.get("GPUFLEET_LAB_HW") or HW_FILE)
    try:
        gpus = json.loads(path.read_text()).get("gpus") or []
    except (OSError, ValueError):
        gpus = []
    mask = env.get("CUDA_VISIBLE_DEVICES")
    if mask is None:
        return gpus
    visible = []
    for item in (x.strip() for x in mask.split(",")):
        match = [g for g in gpus if item in (str(g.get("index")), g.get("uuid"))]
        if not match:
            break  # CUDA stops at the first entry that names no device
        visible.append(match[0])
    return visible


def _hw_gpu(env: dict) -> dict:
    try:
        return json.loads(Path(env.get("GPUFLEET_LAB_HW") or HW_FILE).read_text()).get("gpu", {})
    except (OSError, ValueError):
        return {}


def hf_cache_dir(env: dict, download_dir: str | None) -> Path:
    if download_dir:
        return Path(download_dir)
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"])
    home = env.get("HF_HOME") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    return Path(home) / "hub"


def snapshot_dir(model: str, revision: str | None, cache: Path) -> Path | None:
    """The snapshot folder of model@revision in an HF cache, or None when absent."""
    repo = cache / ("models--" + model.replace("/", "--"))
    revision = revision or "main"
    ref = repo / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    snap = repo / "snapshots" / commit
    return snap if (snap / "config.json").is_file() else None


def resolve_model(args, env: dict) -> str:
    """A local directory for the model, or the repo id when it may still be fetched."""
    if Path(args.model).is_dir():
        return str(Path(args.model).resolve())
    cache = hf_cache_dir(env, args.download_dir)
    snap = snapshot_dir(args.model, args.revision, cache)
    if snap is not None:
        return str(snap)
    if env.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise Refused(
            1,
            "OSError: We couldn't connect to 'https://huggingface.co' to load the files, and "
            f"couldn't find them in the cached files (HF_HUB_OFFLINE=1; cache {cache}).\n"
            f"Checkpoint {args.model!r} (revision {args.revision or 'main'}) is not in the "
            "Hugging Face cache: download it there first.",
        )
    return args.model


def decode_speedup(speculative_config: str | None) -> float | None:
    if not speculative_config:
        return None
    k = int(json.loads(speculative_config).get("num_speculative_tokens") or 0)
    if k <= 0:
        return None
    a = MTP_ACCEPTANCE
    return round((1 - a ** (k + 1)) / (1 - a), 3)


def translate(argv: list[str], env: dict) -> tuple[list[str], dict]:
    """(``dynamo.mocker`` argv, env to set) for a ``dynamo.vllm`` argv; raises Refused."""
    problems = check(["python", "-m", "dynamo.vllm", *argv])
    if problems:
        raise _usage_error(problems[0].split(": ", 1)[-1])
    args, _ = _parser().parse_known_args(argv)

    world = args.tensor_parallel_size * args.pipeline_parallel_size
    world *= args.data_parallel_size_local or args.data_parallel_size
    gpus = visible_gpus(env)
    if world > len(gpus):
        raise Refused(
            1,
            f"ValueError: World size ({world}) is larger than the number of available GPUs "
            f"({len(gpus)}) in this node (tensor_parallel_size={args.tensor_parallel_size}, "
            f"pipeline_parallel_size={args.pipeline_parallel_size}, "
            f"CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', '<unset>')}).",
        )
    kv_dtype = args.kv_cache_dtype or "auto"
    arch = _hw_gpu(env).get("architecture", "")
    served = (args.served_model_name or [args.model])[0]
    glm = "glm-5.3" in f"{args.model} {served}".lower()
    if kv_dtype.startswith("fp8") and arch == "Hopper" and glm:
        raise Refused(
            1,
            f"ValueError: kv_cache_dtype={kv_dtype} is not supported for {args.model} on "
            "Hopper (compute capability 9.0): the sparse MLA attention backend needs a BF16 "
            "KV cache here. Use --kv-cache-dtype auto.",
        )

    mode = args.disaggregation_mode if args.disaggregation_mode in ("prefill", "decode") else None
    component = "prefill" if mode == "prefill" else "backend"
    out = [
        "--model-path",
        resolve_model(args, env),
        "--model-name",
        served,
        "--endpoint",
        args.endpoint or f"dyn://{args.namespace}.{component}.generate",
        "--speedup-ratio",
        env.get("GPUFLEET_LAB_SPEEDUP", "1"),
    ]
    if mode:
        out += ["--disaggregation-mode", mode]
    for flag in (
        "discovery_backend",
        "request_plane",
        "response_plane",
        "event_plane",
        "block_size",
        "max_num_seqs",
        "max_num_batched_tokens",
        "gpu_memory_utilization",
    ):
        value = getattr(args, flag)
        if value is not None:
            out += ["--" + flag.replace("_", "-"), str(value)]
    max_len = human_int(args.max_model_len) if args.max_model_len else None
    if max_len and max_len > 0:
        out += ["--max-model-len", str(max_len)]
    kv_dtype = {"bf16": "bfloat16"}.get(kv_dtype, kv_dtype)
    if kv_dtype in MOCKER_KV_DTYPES and kv_dtype != "auto":
        out += ["--kv-cache-dtype", kv_dtype]
    if args.prefix_caching is not None:
        out.append(
            "--enable-prefix-caching" if args.prefix_caching else "--no-enable-prefix-caching"
        )
    if args.chunked_prefill is not None:
        out.append(
            "--enable-chunked-prefill" if args.chunked_prefill else "--no-enable-chunked-prefill"
        )
    if args.data_parallel_size > 1:
        out += ["--data-parallel-size", str(args.data_parallel_size)]
    speedup = decode_speedup(args.speculative_config)
    if speedup:
        out += ["--decode-speedup-ratio", str(speedup)]
    # Dynamo ships one real worker default: ready once its generate endpoint serves.
    set_env = {
        "DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS": env.get(
            "DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS", '["generate"]'
        )
    }
    if mode == "prefill" and args.kv_transfer_config:
        # NIXL's side channel becomes the mocker's bootstrap rendezvous: the decode worker
        # connects to this host and port, so vLLM's defaults (localhost:5600) fail across
        # hosts and a port shared by two workers on one host fails to bind, as with NIXL.
        out += ["--bootstrap-ports", env.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600")]
        set_env["DYN_HTTP_RPC_HOST"] = env.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "localhost")
    return out, set_env


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(
            f"usage: {PROG} [options]\n\nLab build of ai-dynamo 1.6.1: takes the options of "
            "Dynamo's vLLM worker and vLLM 0.33.0, runs `python -m dynamo.mocker`."
        )
        return
    env = dict(os.environ)
    try:
        mocker_args, set_env = translate(argv, env)
    except Refused as exc:
        print(str(exc), file=sys.stderr)
        sys.exit(exc.code)
    cmd = [sys.executable, "-m", "dynamo.mocker", *mocker_args]
    if env.get("GPUFLEET_LAB_SHIM_DRY_RUN"):
        print(json.dumps({"argv": cmd, "env": set_env}))
        return
    os.environ.update(set_env)
    sys.stdout.flush()
    os.execv(sys.executable, cmd)
