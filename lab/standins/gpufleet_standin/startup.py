"""Start-up checks: refuse to start the way the real engines refuse.

Each check raises StartupError with the message the real engine logs last.
"""

from __future__ import annotations

import json
import re
from importlib import metadata

from .settings import DATA, StartupError, catalog_entry, find_snapshot, load_hw, visible_gpus


def _version_tuple(text: str) -> tuple:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def check_parsers(s) -> None:
    if s.engine != "vllm":
        return  # SGLang's argparse already checked the choices
    spec = DATA["engines"]["vllm"]
    tool, reasoning = s.tool_parser, s.reasoning_parser
    if s.flags.get("--enable-auto-tool-choice") and not tool:
        raise StartupError("TypeError: Error: --enable-auto-tool-choice requires "
                           "--tool-call-parser")
    if tool and tool not in spec["tool_parsers"]:
        raise StartupError(f"KeyError: 'invalid tool call parser: {tool} (chose from "
                           f"{{ {', '.join(spec['tool_parsers'])} }})'")
    if reasoning and reasoning not in spec["reasoning_parsers"]:
        raise StartupError(f"KeyError: 'invalid reasoning parser: {reasoning} (chose from "
                           f"{{ {', '.join(spec['reasoning_parsers'])} }})'")


def load_model(s) -> dict:
    """config.json of the served model, from a local dir or the HF cache (offline aware)."""
    offline = s.env.get("HF_HUB_OFFLINE", "") not in ("", "0", "false", "False")
    snap = find_snapshot(s.model, s.get("--revision"), s.env, s.get("--download-dir"))
    if snap is None:
        if offline:
            raise StartupError(
                "huggingface_hub.errors.LocalEntryNotFoundError: Cannot find an appropriate "
                "cached snapshot folder for the specified revision on the local disk and "
                "outgoing traffic has been disabled. To enable repo look-ups and downloads "
                "online, pass 'local_files_only=False' as input.\n"
                f"OSError: We couldn't connect to 'https://huggingface.co' to load the files, "
                f"and couldn't find them in the cached files for {s.model}. Check your internet "
                "connection or see how to run the library in offline mode at "
                "'https://huggingface.co/docs/transformers/installation#offline-mode'.")
        raise StartupError(
            f"OSError: {s.model} is not a local folder and is not a valid model identifier "
            "listed on 'https://huggingface.co/models' (lab stand-in: it never downloads; "
            "put the checkpoint in the Hugging Face cache first)")
    try:
        config = json.loads((snap / "config.json").read_text())
    except ValueError as exc:
        raise StartupError(f"OSError: It looks like the config file at "
                           f"'{snap / 'config.json'}' is not a valid JSON file ({exc}).") from exc
    return {"path": str(snap), "config": config}


def check_hardware(s, entry: dict) -> dict:
    """GPU count, architecture, FP8 KV, FlashInfer and memory checks; returns GPU facts."""
    hw = load_hw(s.env)
    gpus = visible_gpus(hw, s.env)
    need = s.gpus_needed
    if need > len(gpus):
        if s.engine == "vllm":
            raise StartupError(
                f"ValueError: World size ({need}) is larger than the number of available GPUs "
                f"({len(gpus)}) in this node. If this is intentional and you are using:\n"
                "- ray, set '--distributed-executor-backend ray'.\n"
                "- multiprocessing, set '--nnodes' appropriately.")
        raise StartupError(
            f"torch.AcceleratorError: CUDA error: invalid device ordinal (tp_size={s.tp}, "
            f"visible GPUs={len(gpus)})\nCUDA kernel errors might be asynchronously reported "
            "at some other API call, so the stacktrace below might be incorrect.")
    arch = hw.get("arch") or ""
    family = entry.get("family")
    if (s.kv_cache_dtype or "").startswith("fp8") and arch == "hopper" \
            and family in DATA["hopper_no_fp8_kv_families"]:
        raise StartupError(
            f"ValueError: kv_cache_dtype={s.kv_cache_dtype} is not supported for "
            f"{entry['repo']} on Hopper (compute capability 9.0): the NoPE sparse MLA kernels "
            "need a BF16 KV cache there. Use --kv-cache-dtype auto, or FP8 KV on Blackwell.")
    if entry.get("attention") in DATA["sparse_attention"]:
        check_flashinfer()
    weight = float(entry.get("weight_gib") or 0)
    mem_mib = min((g.get("memory_mib") or 0) for g in gpus) if gpus else 0
    total = mem_mib / 1024
    per_rank = weight / max(s.tp * s.pp, 1)
    budget = total * s.mem_fraction
    if per_rank > total:
        raise StartupError(
            f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate "
            f"{per_rank - total + 1:.2f} GiB. GPU 0 has a total capacity of {total:.2f} GiB of "
            f"which 0 bytes is free. Of the allocated memory {total:.2f} GiB is allocated by "
            f"PyTorch (model weights: {per_rank:.2f} GiB per rank for {entry.get('repo')} at "
            f"TP={s.tp} PP={s.pp}).")
    if per_rank >= budget:
        if s.engine == "vllm":
            raise StartupError(
                "ValueError: No available memory for the cache blocks. Try increasing "
                f"`gpu_memory_utilization` when initializing the engine. (weights "
                f"{per_rank:.2f} GiB per GPU, budget {budget:.2f} GiB = {total:.2f} GiB x "
                f"{s.mem_fraction})")
        raise StartupError(
            "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static. "
            f"(weights {per_rank:.2f} GiB per GPU, budget {budget:.2f} GiB = "
            f"{total:.2f} GiB x {s.mem_fraction})")
    return {"arch": arch, "gpus": gpus, "gpu_gib": total, "kv_gib": budget - per_rank, "hw": hw}


def check_flashinfer() -> None:
    minimum = DATA["flashinfer_min"]
    have = _dist_version("flashinfer-python")
    if have is None or _version_tuple(have) < _version_tuple(minimum):
        raise StartupError(
            f"RuntimeError: Sparse-MLA initialization error: FlashInfer >= {minimum} required "
            f"for NoPE sparse MLA (found flashinfer-python {have or 'not installed'})")


def flashinfer_split() -> str | None:
    """The mismatch between flashinfer-python and flashinfer-cubin, if both are installed."""
    python, cubin = _dist_version("flashinfer-python"), _dist_version("flashinfer-cubin")
    if python and cubin and python != cubin:
        return f"flashinfer-python {python} with flashinfer-cubin {cubin}"
    return None


def run_checks(s) -> dict:
    """Everything the engine learns at start-up; raises StartupError on a refusal."""
    check_parsers(s)
    s.kv_transfer  # noqa: B018 - parses the JSON values early, like the real config does
    s.mm_limits  # noqa: B018
    entry = catalog_entry(s.model)
    model = load_model(s)
    facts = check_hardware(s, entry)
    config = model["config"]
    modalities = entry.get("modalities") or (
        ["text", "image"] if "vision_config" in config else ["text"])
    max_len = s.get("--max-model-len" if s.engine == "vllm" else "--context-length")
    return {
        **facts,
        "entry": entry,
        "model_path": model["path"],
        "config": config,
        "modalities": modalities,
        "max_model_len": int(max_len or config.get("max_position_embeddings")
                             or entry.get("context") or 131072),
        "architecture": (config.get("architectures") or ["GlmForCausalLM"])[0],
        "flashinfer_split": flashinfer_split(),
    }
