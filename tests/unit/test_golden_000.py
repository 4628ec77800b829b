"""Seed 000's commands come out of the planner flag for flag.

The seed's shell blocks are parsed from the seed text itself (a copy in
tests/fixtures/seeds), so a change to the catalog that drops or alters any flag,
value or environment pin fails here. What the plan adds on top must be one of the
implied additions listed below, each with its reason.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from gpufleet.plan import make_plan

SEED = Path(__file__).parents[1] / "fixtures" / "seeds" / "000_5e664c6e94ff2f6a.txt"

# What the plan adds to the seed, and why.
IMPLIED_FLAGS = {
    "--port",                     # explicit, so the health checks and router agree on it
    "--host",                     # engines behind a same-host router listen on loopback only
    "--tool-call-parser",         # parsers on every target that serves chat (the issue)
    "--reasoning-parser",
    "--enable-auto-tool-choice",
    "--limit-mm-per-prompt",      # 002 promises one image per prompt (issue 10)
    "--revision",                 # the checkpoint's commit, pinned by the deploy (docs/plan.md)
    "--prometheus-host",          # the router's metrics on loopback, for the metrics listener
    "--prometheus-port",
}
IMPLIED_ENV = {
    "CUDA_VISIBLE_DEVICES",        # GPUs pinned for every engine unit
    "HF_HUB_OFFLINE",              # read from the shared cache, offline (002)
    "HF_HUB_CACHE",
    "VLLM_NIXL_SIDE_CHANNEL_HOST", # defaults to localhost, wrong across hosts
    "VLLM_CACHE_ROOT",             # the compile caches on the shared cache, one per
    "TRITON_CACHE_DIR",            # engine build and GPU type (the service user's home
    "FLASHINFER_WORKSPACE_BASE",   # is per host)
}


def seed_commands() -> list[tuple[dict, list[str]]]:
    """(env, argv) for every shell command in the seed."""
    commands, current = [], []
    for line in SEED.read_text().splitlines():
        starts = line.startswith(("vllm serve", "vllm-router", "CUDA_VISIBLE_DEVICES"))
        if current or starts:
            current.append(line.rstrip("\\").strip())
            if not line.rstrip().endswith("\\"):
                tokens = shlex.split(" ".join(current))
                env = {}
                while "=" in tokens[0] and not tokens[0].startswith("-"):
                    key, _, value = tokens.pop(0).partition("=")
                    env[key] = value
                commands.append((env, tokens))
                current = []
    return commands


def flags(tokens: list[str]) -> dict[str, object]:
    out: dict[str, object] = {}
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok.startswith("--"):
            if i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
                value = tokens[i + 1]
                out[tok] = json.loads(value) if value.startswith("{") else value
                i += 2
                continue
            out[tok] = True
        i += 1
    return out


# The one value the plan changes, and why: the API gateway (nginx checking the key)
# holds the public address, so the router behind it listens on loopback. With
# `api_key: false` the router's command is the seed's exactly (tested below).
BEHIND_GATEWAY = {"--host": "127.0.0.1"}


def assert_matches(seed_env, seed_argv, process, extra_flags=(), changed=None):
    argv = process.argv
    assert Path(argv[0]).name == seed_argv[0]
    if seed_argv[0] == "vllm":
        assert argv[1:3] == seed_argv[1:3]  # serve MODEL
    want = flags(seed_argv)
    want.update(changed or {})
    got = flags(argv)
    for flag, value in want.items():
        assert flag in got, f"{process.name}: seed flag {flag} missing"
        assert got[flag] == value, f"{process.name}: {flag} is {got[flag]!r}, seed {value!r}"
    extras = set(got) - set(want)
    assert extras <= IMPLIED_FLAGS | set(extra_flags), f"unexplained flags {extras}"
    for key, value in seed_env.items():
        assert process.env.get(key) == value, f"{process.name}: env {key}"
    assert set(process.env) - set(seed_env) <= IMPLIED_ENV


@pytest.fixture(scope="module")
def seed():
    commands = seed_commands()
    assert len(commands) == 4, "expected the agg, prefill, decode and router commands"
    return commands


def test_gb200_tray_is_the_aggregated_command(seed):
    env, argv = seed[0]
    (worker,) = make_plan("gb200-tray").by_role("worker")
    assert_matches(env, argv, worker)


@pytest.mark.parametrize("target,extra", [("h200-pd-1node", ()),
                                          ("b200-pd-1node", ("--kv-cache-dtype",))])
def test_pd_pools_and_router_match_the_seed(seed, target, extra):
    plan = make_plan(target)
    (prefill,), (decode,), (router,) = (plan.by_role(r) for r in ("prefill", "decode", "router"))
    assert_matches(*seed[1], prefill, extra)
    assert_matches(*seed[2], decode, extra)
    assert_matches(*seed[3], router, changed=BEHIND_GATEWAY)
    assert prefill.gpus == [0, 1, 2, 3] and decode.gpus == [4, 5, 6, 7]


def test_hopper_runs_bf16_kv_and_blackwell_fp8_kv():
    h200 = make_plan("h200-pd-1node")
    b200 = make_plan("b200-pd-1node")
    assert all("--kv-cache-dtype" not in p.argv for p in h200.processes)
    for role in ("prefill", "decode"):
        (p,) = b200.by_role(role)
        assert p.argv[p.argv.index("--kv-cache-dtype") + 1] == "fp8"


def test_pd_pools_keep_the_seeds_hybrid_kv_spelling(seed):
    """000's --no-disable-hybrid-kv-cache-manager is rendered as written, not translated,
    and the pinned vLLM's flag check accepts it."""
    from gpufleet import engine_flags

    assert "--no-disable-hybrid-kv-cache-manager" in seed[1][1]
    for role in ("prefill", "decode"):
        (p,) = make_plan("h200-pd-1node").by_role(role)
        assert "--no-disable-hybrid-kv-cache-manager" in p.argv
        assert "--enable-hybrid-kv-cache-manager" not in p.argv
        assert engine_flags.check(p.argv) == []


def test_the_parser_finds_a_changed_value(seed):
    """The comparison itself can fail: a seed flag with another value is caught."""
    env, argv = seed[0]
    (worker,) = make_plan("gb200-tray").by_role("worker")
    worker.argv[worker.argv.index("--tensor-parallel-size") + 1] = "8"
    with pytest.raises(AssertionError, match="tensor-parallel-size"):
        assert_matches(env, argv, worker)


def test_without_the_key_the_router_is_the_seeds_exactly(seed):
    plan = make_plan("h200-pd-1node", None, {"api_key": False})
    (router,) = plan.by_role("router")
    assert_matches(*seed[3], router)
    assert not plan.by_role("gateway")


def test_the_gateway_takes_the_seeds_client_port(seed):
    plan = make_plan("h200-pd-1node")
    (gateway,), (router,) = plan.by_role("gateway"), plan.by_role("router")
    assert gateway.ports == {"http": 8000}
    assert router.ports == {"http": 8000, "metrics": 29000}  # its metrics on loopback
    assert "--prometheus-host=127.0.0.1" in router.argv or \
        router.argv[router.argv.index("--prometheus-host") + 1] == "127.0.0.1"
    assert gateway.bind == gateway.address and router.bind == "127.0.0.1"
    assert plan.endpoint == f"https://{gateway.address}:8000/v1"
    assert plan.api["key_required"] and plan.endpoints == [plan.endpoint]
