"""What a stand-in engine was started with: argv values, lab hardware, the cached model.

The argv is checked with the vendored ``engine_flags`` (the same module and tables the
planner uses); this module only pulls values out of an argv that already parsed.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from . import engine_flags

HERE = Path(__file__).parent
DATA = json.loads((HERE / "standin.json").read_text())
METRICS = json.loads((HERE / "metrics.json").read_text())  # what /metrics exposes
HW_PATH = "/etc/gpufleet-lab/hw.json"


class StartupError(Exception):
    """The engine refuses to start; ``args[0]`` is the real-looking log text."""


def flag_values(program: str, args: list[str], aliases: dict[str, str]) -> dict:
    """{long flag: value} for an argv that engine_flags.check accepted.

    Flags without a value map to True (``--no-X`` to False); repeated flags keep the last
    value; flags that take several values keep the list. Positionals land under "".
    """
    table = engine_flags.table(program)
    out: dict = {}
    i = 0
    while i < len(args):
        token = args[i]
        i += 1
        if not engine_flags._is_option(token):
            out.setdefault("", token)
            continue
        flag, eq, inline = token.partition("=")
        spec = table.get(flag, {})
        flag = aliases.get(flag, flag)
        if eq:
            out[flag] = inline
            continue
        mode = engine_flags._takes_value(spec, args[i] if i < len(args) else None)
        if mode == "none":
            positive = "--" + flag[5:]
            if flag.startswith("--no-") and positive in table:
                out[positive] = False
            else:
                out[flag] = True
            continue
        values = []
        while i < len(args) and not engine_flags._is_option(args[i]):
            values.append(args[i])
            i += 1
            if mode in ("one", "optional"):
                break
        out[flag] = values if mode == "many" else (values[0] if values else True)
    return out


def _json(value, flag: str):
    if value in (None, True):
        return None
    try:
        return json.loads(value)
    except ValueError as exc:
        raise StartupError(f"argument {flag}: invalid loads value: {value!r} ({exc})") from exc


def _first(value):
    return value[0] if isinstance(value, list) else value


@dataclass
class Settings:
    engine: str  # "vllm" | "sglang"
    argv: list[str]
    flags: dict
    env: dict = field(default_factory=lambda: dict(os.environ))

    def get(self, flag: str, default=None):
        value = self.flags.get(flag)
        if value is None:
            value = DATA["engines"][self.engine]["defaults"].get(flag, default)
        return _first(value)

    def num(self, flag: str, kind=int):
        return kind(self.get(flag))

    # --- common values -------------------------------------------------------------
    @property
    def model(self) -> str:
        if self.engine == "vllm":
            return self.flags.get("") or self.get("--model") or "facebook/opt-125m"
        return self.get("--model-path") or ""

    @property
    def served_name(self) -> str:
        return self.get("--served-model-name") or self.model

    @property
    def host(self) -> str:
        return self.get("--host") or "0.0.0.0"

    @property
    def port(self) -> int:
        return self.num("--port")

    @property
    def api_keys(self) -> list[str]:
        value = self.flags.get("--api-key") or self.env.get("VLLM_API_KEY" if self.engine ==
                                                            "vllm" else "SGLANG_API_KEY")
        if not value:
            return []
        return value if isinstance(value, list) else [value]

    @property
    def tp(self) -> int:
        return self.num("--tensor-parallel-size" if self.engine == "vllm" else "--tp-size")

    @property
    def pp(self) -> int:
        return self.num("--pipeline-parallel-size" if self.engine == "vllm" else "--pp-size")

    @property
    def gpus_needed(self) -> int:
        """GPUs this process needs on its own node (what the real engines check)."""
        nnodes = max(self.num("--nnodes"), 1)
        if self.engine == "vllm":
            local = self.get("--data-parallel-size-local")
            dp = int(local) if local else self.num("--data-parallel-size")
            total = self.tp * self.pp * dp
            return total if local else max(total // nnodes, 1)
        dp = 1 if self.flags.get("--enable-dp-attention") else self.num("--dp-size")
        return max(self.tp * self.pp * dp // nnodes, 1)

    @property
    def mem_fraction(self) -> float:
        return self.num(DATA["engines"][self.engine]["mem_fraction_flag"], float)

    @property
    def kv_cache_dtype(self) -> str:
        return self.get("--kv-cache-dtype")

    @property
    def reasoning_parser(self) -> str | None:
        return self.get("--reasoning-parser")

    @property
    def tool_parser(self) -> str | None:
        return self.get("--tool-call-parser")

    @property
    def speculative(self) -> dict | None:
        if self.engine == "vllm":
            return _json(self.get("--speculative-config"), "--speculative-config")
        algo = self.get("--speculative-algorithm")
        if not algo or algo is True:
            return None
        return {k: self.get(f"--speculative-{k.replace('_', '-')}")
                for k in ("algorithm", "num_steps", "eagle_topk", "num_draft_tokens")}

    @property
    def kv_transfer(self) -> dict | None:
        return _json(self.get("--kv-transfer-config"), "--kv-transfer-config")

    @property
    def pd_mode(self) -> str | None:
        """'prefill', 'decode', 'both' or None."""
        if self.engine == "sglang":
            mode = self.get("--disaggregation-mode")
            return None if mode == "null" else mode
        cfg = self.kv_transfer or {}
        role = cfg.get("kv_role")
        return {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}.get(role)

    @property
    def mm_limits(self) -> dict:
        return _json(self.get("--limit-mm-per-prompt"), "--limit-mm-per-prompt") or {}


def parse(engine: str, args: list[str], version: str | None = None
          ) -> tuple[Settings | None, list[str]]:
    """(settings, problems) for the arguments after the program name, as the engine's
    release `version` parses them."""
    spec = DATA["engines"][engine]
    program = spec["program"]
    argv = ["vllm", "serve", *args] if engine == "vllm" else ["python", "-m", program, *args]
    problems = engine_flags.check(argv, version)
    if problems:
        return None, problems
    return Settings(engine, argv, flag_values(program, args, spec["aliases"])), []


# --- lab hardware --------------------------------------------------------------------
def load_hw(env: dict) -> dict:
    path = Path(env.get("GPUFLEET_LAB_HW") or HW_PATH)
    try:
        hw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {"gpus": [], "arch": None}
    # hwsim writes one shared GPU spec (`gpu`) and per-device entries (`gpus`); a raw
    # profile has only the spec and `bus_ids`.
    spec = hw.get("gpu") if isinstance(hw.get("gpu"), dict) else {}
    gpus = hw.get("gpus")
    if gpus is None:
        gpus = [{"index": i} for i in range(len(hw.get("bus_ids") or []))]
    gpus = [{"name": spec.get("name"), "memory_mib": spec.get("memory_mib"), **g} for g in gpus]
    arch = hw.get("arch") or (hw.get("gpu") or {}).get("architecture") or ""
    return {**hw, "gpus": gpus or [], "arch": str(arch).lower() or None}


def visible_gpus(hw: dict, env: dict) -> list[dict]:
    """The lab host's GPUs that CUDA_VISIBLE_DEVICES (or HIP_/ROCR_) leaves visible."""
    gpus = list(hw["gpus"])
    for var in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"):
        if var not in env:
            continue
        wanted = [x.strip() for x in env[var].split(",") if x.strip()]
        by_key = {str(g.get("index")): g for g in gpus} | {str(g.get("uuid")): g for g in gpus}
        gpus = [by_key[w] for w in wanted if w in by_key]
    return gpus


# --- models --------------------------------------------------------------------------
def catalog() -> dict:
    return json.loads((HERE / "catalog" / "models.json").read_text())


def catalog_entry(model: str) -> dict:
    """The models.yml entry whose repo names this model (repo id or a path ending in it)."""
    flat = model.replace("models--", "").replace("--", "/")
    for entry in catalog().values():
        repo = entry["repo"]
        if model == repo or model.rstrip("/").endswith("/" + repo) or repo in flat.split(
                "/snapshots/")[0]:
            return entry
    return {}


def hub_cache(env: dict, download_dir: str | None = None) -> Path:
    if download_dir:
        return Path(download_dir)
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"])
    home = env.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return Path(home) / "hub"


def find_snapshot(model: str, revision: str, env: dict, download_dir=None) -> Path | None:
    """The directory holding the model's config.json (local dir or HF cache snapshot)."""
    local = Path(model)
    if local.is_dir():
        return local if (local / "config.json").is_file() else None
    # huggingface_hub's offline lookup: refs/<revision> names the snapshot, else the
    # revision is a commit with a snapshot of its own; no other snapshot stands in for it
    repo_dir = hub_cache(env, download_dir) / ("models--" + model.replace("/", "--"))
    revision = revision or "main"
    ref = repo_dir / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    snap = repo_dir / "snapshots" / commit
    return snap if (snap / "config.json").is_file() else None
