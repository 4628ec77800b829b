"""``python -m dynamo.vllm`` in the lab: check the real worker's argv, then serve.

1. The argv is checked against the option tables of Dynamo 1.6.1's vLLM worker plus
   vLLM 0.31.0 (``engine_flags.py``, the same checker the planner uses): an unknown
   flag, a bad choice or broken JSON exits 2 with an argparse-style message.
2. Misconfigurations a real worker refuses at startup are refused here too: tensor x
   pipeline (x local data) parallel size larger than the GPUs this process can see
   (``/etc/gpufleet-lab/hw.json`` ``gpus``, or ``$GPUFLEET_LAB_HW``, filtered by
   ``CUDA_VISIBLE_DEVICES``), FP8 KV cache for GLM-5.3-Flash on Hopper, and a
   checkpoint missing from the Hugging Face cache while ``HF_HUB_OFFLINE=1``.
3. It then runs ``worker.py``: Dynamo's backend SDK registers the checkpoint (snapshot
   folder in the HF cache) under the served name with the ``--dyn-*-parser`` names, in
   the same disaggregation mode, namespace, discovery/request/event planes, and streams
   the stand-in model's answers.

With ``--kv-transfer-config`` a prefill worker listens on its NIXL side channel
(``VLLM_NIXL_SIDE_CHANNEL_HOST``/``_PORT``, vLLM's defaults localhost/5600) and hands
that address to the decode worker, which connects there before answering.

``GPUFLEET_LAB_SHIM_DRY_RUN=1`` prints ``{"worker": {...settings}}`` instead of running.
``GPUFLEET_LAB_SPEEDUP`` divides the simulated prefill and decode time (default 1).
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
    a("--dyn-tool-call-parser")
    a("--limit-mm-per-prompt")
    a("--dyn-reasoning-parser")
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
    """The lab worker's settings for a ``dynamo.vllm`` argv; raises Refused."""
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

    mode = args.disaggregation_mode if args.disaggregation_mode in ("prefill", "decode") else "agg"
    component = "prefill" if mode == "prefill" else "backend"
    endpoint = args.endpoint or f"dyn://{args.namespace}.{component}.generate"
    namespace, component, name = _endpoint_parts(endpoint)
    max_len = human_int(args.max_model_len) if args.max_model_len else None
    config = {
        "model_path": resolve_model(args, env),
        "served": served,
        "namespace": namespace,
        "component": component,
        "endpoint": name,
        "mode": mode,
        "discovery_backend": args.discovery_backend or env.get("DYN_DISCOVERY_BACKEND", "etcd"),
        "request_plane": args.request_plane or env.get("DYN_REQUEST_PLANE", "tcp"),
        "response_plane": args.response_plane or env.get("DYN_RESPONSE_PLANE", "tcp"),
        # Dynamo's vLLM worker defaults to ZMQ events; the SDK would pick NATS for etcd.
        "event_plane": args.event_plane or env.get("DYN_EVENT_PLANE") or "zmq",
        "tool_call_parser": args.dyn_tool_call_parser,
        "reasoning_parser": args.dyn_reasoning_parser,
        "block_size": args.block_size or 16,
        "max_model_len": max_len if max_len and max_len > 0 else None,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "speedup": float(env.get("GPUFLEET_LAB_SPEEDUP") or 1),
        "decode_speedup": decode_speedup(args.speculative_config) or 1.0,
        "limit_mm_per_prompt": json.loads(args.limit_mm_per_prompt or "{}"),
    }
    if mode == "prefill" and args.kv_transfer_config:
        # NIXL's side channel: the decode worker connects to this host and port before it
        # takes the KV, so vLLM's defaults (localhost:5600) fail across hosts and two
        # workers on one host and port fail to bind, as with NIXL.
        config["side_channel"] = {
            "host": env.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "localhost"),
            "port": int(env.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600")),
        }
    return config


def _endpoint_parts(endpoint: str) -> tuple[str, str, str]:
    parts = endpoint.removeprefix("dyn://").split(".")
    if len(parts) != 3 or not all(parts):
        raise _usage_error(
            f"argument --endpoint: expected dyn://namespace.component.endpoint, got {endpoint!r}"
        )
    return parts[0], parts[1], parts[2]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(
            f"usage: {PROG} [options]\n\nLab build of ai-dynamo 1.6.1: takes the options of "
            "Dynamo's vLLM worker and vLLM 0.33.0 and serves the lab's stand-in model."
        )
        return
    env = dict(os.environ)
    try:
        config = translate(argv, env)
    except Refused as exc:
        print(str(exc), file=sys.stderr)
        sys.exit(exc.code)
    if env.get("GPUFLEET_LAB_SHIM_DRY_RUN"):
        print(json.dumps({"worker": config}))
        return
    from .worker import serve  # imports Dynamo's runtime: only when serving

    sys.stdout.flush()
    serve(config)
