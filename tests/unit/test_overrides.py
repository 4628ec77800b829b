"""Overrides are checked as the engines check them: flags the plan computes are refused
with the setting that changes them everywhere, and values an engine would refuse at
start-up are refused before any host is touched (catalog/engines.yml `managed` and
`limits`, gpufleet/overrides.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpufleet import catalog as cat
from gpufleet import engine_flags, rules
from gpufleet.plan import ENGINE_ROLES, OWN_PROGRAM, PlanError, make_plan

ROOT = Path(__file__).parents[2]
FAB = [sys.executable, "-m", "gpufleet"]  # the checkout's fab program


def fab_plan(*args):
    return subprocess.run([*FAB, "plan", *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "NO_COLOR": "1"}, check=False)


def refusal(target, overrides) -> list[str]:
    with pytest.raises(PlanError) as err:
        make_plan(target, None, overrides)
    messages = [str(p) for p in err.value.problems]
    assert all("Fix: " in m for m in messages), messages
    return messages


def argv(plan, name):
    return next(p for p in plan.processes if p.name == name).argv


# ------------------------------------------------------------- the three examples

@pytest.mark.parametrize("setting,texts", [
    ("decode:--port=8001", [
        "args.decode.--port", "--port on decode is set by the plan", "setting it to 8001",
        "Fix: set the port in the inventory: gpufleet_ports: {decode: {http: PORT}}"]),
    ("decode:--gpu-memory-utilization=1.5", [
        "decode.--gpu-memory-utilization", "decode: --gpu-memory-utilization 1.5 is above 1",
        "vLLM CacheConfig", "Fix: set --gpu-memory-utilization on decode to a number above 0 "
        "and at most 1"]),
    ("decode:--max-model-len=99999999", [
        "decode: --max-model-len 99999999 is above 1,048,576 tokens, the context of "
        "zai-org/GLM-5.3-Flash (gpufleet/catalog/models.yml)", "vLLM ModelConfig",
        "Fix: set --max-model-len on decode to an integer at least 1 and at most 1048576"]),
])
def test_fab_plan_refuses_the_three_examples_with_exit_2(setting, texts):
    proc = fab_plan("--target", "h200-pd-1node", "--set", setting)
    assert proc.returncode == 2, proc.stdout
    assert "nothing was changed" in proc.stderr
    for text in texts:
        assert text in proc.stderr


def test_valid_overrides_pass_and_reach_the_command_line():
    proc = fab_plan("--target", "h200-pd-1node", "--set", "decode:--max-num-seqs=256",
                    "--set", "decode:--gpu-memory-utilization=0.85",
                    "--set", "decode:--max-model-len=131072")
    assert proc.returncode == 0, proc.stderr
    decode = proc.stdout.split("# decode on")[1].split("\n# ")[0]
    for text in ("--max-num-seqs 256", "--gpu-memory-utilization 0.85",
                 "--max-model-len 131072"):
        assert text in decode


def test_the_way_the_port_refusal_names_reaches_every_consumer():
    plan = make_plan("h200-pd-1node", None, {"ports": {"decode": {"http": 8003}}})
    decode = argv(plan, "decode")
    assert decode[decode.index("--port") + 1] == "8003"
    router = argv(plan, "router")
    assert router[router.index("--decode") + 1] == "http://127.0.0.1:8003"
    assert 8003 in plan.hosts["workers-1"].ports


# ------------------------------------------------------------------------ managed flags

MANAGED = [
    # target, overrides, text in the message, text in the fix
    ("h200-pd-1node", {"args": {"decode": {"--host": None}}},
     "dropping it would change only decode's command line", "gpufleet_internal_address"),
    ("h200-pd-1node", {"args": {"engines": {"--port": 9000}}},
     "the engines' command line", "gpufleet_ports: {decode/prefill: {http: PORT}}"),
    ("h200-pd-1node", {"env": {"decode": {"CUDA_VISIBLE_DEVICES": "0,1"}}},
     "only decode's environment", "gpufleet_gpus: {decode: [0, 1, ...]}"),
    ("h200-pd-1node", {"env": {"prefill": {"VLLM_NIXL_SIDE_CHANNEL_PORT": "6000"}}},
     "prefill's nixl port", "gpufleet_ports: {prefill: {nixl: PORT}}"),
    ("h200-pd-1node", {"args": {"decode": {"--kv-transfer-config": {"kv_connector": "x"}}}},
     "pairs the prefill and decode pools", "pick a target"),
    ("h200-pd-1node", {"args": {"router": {"--decode": "http://10.0.0.9:8002"}}},
     "the router's workers are the plan's processes", "gpufleet_ports"),
    ("h200-pd-1node", {"args": {"decode": {"--served-model-name": "glm"}}},
     "the target's checkpoint", "gpufleet_model_revision"),
    ("h200-pd-1node", {"env": {"engines": {"HF_HUB_CACHE": "/tmp/hub"}}},
     "the cache step downloads to it", "gpufleet_cache_dir"),
    ("h200-agg", {"args": {"worker": {"--discovery-backend": "etcd"}}},
     "discover each other the same way", "pick an agg"),
    ("h200-agg", {"args": {"router": {"--http-port": 8080}}},
     "router's http port", "gpufleet_ports: {router: {http: PORT}}"),
    ("h200-disagg", {"env": {"decode": {"DYN_SYSTEM_PORT": "9191"}}},
     "decode's system port", "gpufleet_ports: {decode: {system: PORT}}"),
    ("h200-disagg", {"args": {"etcd": {"--listen-peer-urls": "http://10.0.0.1:2390"}}},
     "etcd's peer port", "gpufleet_ports: {etcd: {peer: PORT}}"),
    ("sglang-h200-low-latency-bf16", {"args": {"worker": {"--node-rank": 0}}},
     "numbers the nodes itself", "list the hosts in the inventory"),
    ("sglang-h200-low-latency-bf16", {"args": {"worker": {"--dist-init-addr": "10.0.0.1:1"}}},
     "worker's dist port", "gpufleet_ports: {worker: {dist: PORT}}"),
    ("sglang-h200-pd", {"args": {"prefill": {"--disaggregation-bootstrap-port": 9000}}},
     "prefill's bootstrap port", "gpufleet_ports: {prefill: {bootstrap: PORT}}"),
    ("sglang-h200-pd", {"args": {"decode": {"--disaggregation-mode": "prefill"}}},
     "pairs the prefill and decode pools", "pick a target"),
    ("sglang-h200-low-latency", {"args": {"engines": {"--model-path": "x/y"}}},
     "the target's checkpoint", "fab targets"),
    ("sglang-h200-low-latency", {"args": {"worker": {"--base-gpu-id": 4}}},
     "pins each role to its GPUs", "gpufleet_gpus: {worker:"),
    ("sglang-h200-low-latency", {"args": {"worker": {"--speculative-draft-model-path": "a/b"}}},
     "the option's draft checkpoint", "--with dflash2"),
]


@pytest.mark.parametrize("target,overrides,text,fix", MANAGED,
                         ids=[f"{c[0]}-{next(iter(next(iter(c[1].values())).values()))}"
                              for c in MANAGED])
def test_flags_the_plan_computes_are_refused_with_the_way_to_set_them(
        target, overrides, text, fix):
    (what, roles), = overrides.items()
    (role, values), = roles.items()
    (key, _), = values.items()
    messages = refusal(target, overrides)
    mine = [m for m in messages if m.startswith(f"{what}.{role}.{key}: ")]
    assert len(mine) == 1, messages
    message, _, fixed = mine[0].partition(". Fix: ")
    assert f"{key} on {role} is set by the plan for {target}" in message
    assert text in message
    assert fix in fixed


def _target_running(catalog, engine: str, role: str) -> tuple[str, dict]:
    """A target whose processes include role, run by engine (its own program for etcd), and
    the overrides that give it that role (a pool's router: gpufleet_workers)."""
    for pooled in (False, True):
        for name, target in sorted(catalog.targets.items()):
            topology = catalog.topologies[target.topology]
            if pooled and not topology.pooled:
                continue
            shown = catalog.topologies[topology.pooled] if pooled else topology
            roles = {p.role for p in shown.processes}
            if role in roles and (role in OWN_PROGRAM or target.engine == engine):
                return name, ({"workers": {"worker": 2}} if pooled else {})
    raise AssertionError(f"no target runs {role} with {engine}")


def _managed_entries():
    catalog = cat.load()
    for engine, entry in sorted(catalog.engines.items()):
        for program, managed in entry.managed.items():
            role = {"engine": "decode", "router": "router"}.get(program, program)
            for what in ("args", "env"):
                for key in getattr(managed, what):
                    yield engine, program, role, what, key


@pytest.mark.parametrize("engine,program,role,what,key", list(_managed_entries()))
def test_every_managed_entry_is_refused(engine, program, role, what, key):
    catalog = cat.load()
    if program == "engine":  # the first engine role a target of this engine runs
        role = next(r for r in ENGINE_ROLES
                    for t in catalog.targets.values() if t.engine == engine
                    if r in {p.role for p in catalog.topologies[t.topology].processes})
    target, pool = _target_running(catalog, engine, role)
    messages = refusal(target, {**pool, what: {role: {key: "1"}}})
    assert any(m.startswith(f"{what}.{role}.{key}: ") for m in messages), messages


def _table_key(engine: str, program: str) -> str | None:
    """The engine_flags program key of a catalog program (None: no flag table, etcd)."""
    prefix = cat.load().engines[engine].programs[program]
    return engine_flags.program_of([x.replace("{model.repo}", "m") for x in prefix])[0]


@pytest.mark.parametrize("engine,program,role,what,key",
                         [e for e in _managed_entries() if e[3] == "args" and _table_key(*e[:2])])
def test_every_managed_flag_is_a_real_flag_of_its_program(engine, program, role, what, key):
    key_of = _table_key(engine, program)
    assert key in engine_flags.table(key_of), f"{key} is not a flag of {key_of}"


def test_unmanaged_overrides_of_the_same_role_still_pass():
    plan = make_plan("h200-disagg", None, {
        "args": {"decode": {"--max-num-seqs": 64}, "router": {"--router-mode": "round-robin"}},
        "env": {"engines": {"UCX_NET_DEVICES": "mlx5_0:1"}}})
    assert "64" in argv(plan, "decode")
    assert next(p for p in plan.processes if p.name == "prefill").env["UCX_NET_DEVICES"] \
        == "mlx5_0:1"


# ----------------------------------------------------------------------- engine limits

REFUSED = [
    # target, role, flags, text the message must contain
    ("h200-pd-1node", "decode", {"--gpu-memory-utilization": 0}, "0 is not above 0"),
    ("h200-pd-1node", "decode", {"--gpu-memory-utilization": "1.01"}, "1.01 is above 1"),
    ("h200-pd-1node", "decode", {"--gpu-memory-utilization": "most"}, "'most' is not a number"),
    ("h200-pd-1node", "decode", {"--max-model-len": 1048577}, "1048577 is above 1,048,576"),
    ("h200-pd-1node", "decode", {"--max-model-len": "2M"}, "2M (2097152) is above 1,048,576"),
    ("h200-pd-1node", "decode", {"--max-model-len": 0}, "0 is below 1"),
    ("h200-pd-1node", "decode", {"--max-num-seqs": 0}, "--max-num-seqs 0 is below 1"),
    ("h200-pd-1node", "decode", {"--max-num-seqs": "1.5"}, "'1.5' is not an integer"),
    ("h200-pd-1node", "prefill", {"--max-num-batched-tokens": 0}, "0 is below 1"),
    ("h200-agg", "worker", {"--max-num-seqs": 16384},
     "--max-num-batched-tokens 8192 is below --max-num-seqs 16384"),
    ("h200-pd-1node", "decode",
     {"--disable-chunked-prefill": True, "--max-num-batched-tokens": 65536},
     "--max-num-batched-tokens 65536 is below --max-model-len 1048576 (the engine's default"),
    ("h200-disagg", "decode", {"--max-model-len": 2000000}, "the context of zai-org/GLM-5.3-Flash"),
    ("gb200-tray", "worker", {"--tensor-parallel-size": 0}, "--tensor-parallel-size 0 is below 1"),
    ("sglang-h200-low-latency", "worker", {"--mem-fraction-static": 1.0}, "1 is not below 1"),
    ("sglang-h200-low-latency", "worker", {"--mem-fraction-static": -0.1}, "-0.1 is not above 0"),
    ("sglang-h200-low-latency", "worker", {"--context-length": 1048577},
     "1048577 is above 1,048,576 tokens, the context of zai-org/GLM-5.3 "),
    ("sglang-h200-low-latency", "worker", {"--max-running-requests": 0}, "0 is below 1"),
    ("sglang-h200-balanced", "worker", {"--dp-size": 3},
     "--tp-size 8 is not a multiple of --dp-size 3"),
    ("sglang-h200-low-latency", "worker", {"--chunked-prefill-size": 1000, "--page-size": 64},
     "--chunked-prefill-size 1000 is not a multiple of --page-size 64"),
    ("sglang-h200-pd", "prefill", {"--chunked-prefill-size": 1000, "--page-size": 64},
     "--chunked-prefill-size 1000 is not a multiple of --page-size 64"),
]


@pytest.mark.parametrize("target,role,flags,text", REFUSED,
                         ids=[f"{c[0]}-{'-'.join(map(str, c[2].values()))}" for c in REFUSED])
def test_values_the_engine_refuses_at_start_up_are_refused(target, role, flags, text):
    messages = refusal(target, {"args": {role: flags}})
    mine = [m for m in messages if text in m]
    assert mine, messages
    assert mine[0].split(": ", 1)[1].startswith(f"{role}: ")  # names the role
    assert "(" in mine[0] and ")" in mine[0]  # and where the limit comes from


ACCEPTED = [
    ("h200-pd-1node", "decode", {"--gpu-memory-utilization": 1}),
    ("h200-pd-1node", "decode", {"--max-model-len": 1048576}),
    ("h200-pd-1node", "decode", {"--max-model-len": "1M"}),  # vLLM reads 1M as 1048576
    ("h200-pd-1node", "decode", {"--max-model-len": "auto"}),
    ("h200-pd-1node", "decode", {"--max-num-seqs": 1}),
    ("h200-pd-1node", "decode", {"--disable-chunked-prefill": True,
                                 "--max-num-batched-tokens": 32768, "--max-model-len": 32768}),
    ("h200-agg", "worker", {"--max-num-seqs": 8192}),
    ("sglang-h200-low-latency", "worker", {"--mem-fraction-static": 0.85}),
    ("sglang-h200-low-latency", "worker", {"--context-length": 1048576}),
    ("sglang-h200-balanced", "worker", {"--dp-size": 4}),
    ("sglang-h200-low-latency", "worker", {"--chunked-prefill-size": -1, "--page-size": 64}),
    ("sglang-h200-low-latency", "worker", {"--chunked-prefill-size": 8192, "--page-size": 64}),
    # a decode worker does not chunk prefills: SGLang skips the page-size check there
    ("sglang-h200-pd", "decode", {"--chunked-prefill-size": 1000, "--page-size": 64}),
]


@pytest.mark.parametrize("target,role,flags", ACCEPTED,
                         ids=[f"{c[0]}-{'-'.join(map(str, c[2].values()))}" for c in ACCEPTED])
def test_values_the_engine_accepts_plan_and_reach_the_command_line(target, role, flags):
    plan = make_plan(target, None, {"args": {role: flags}})
    line = [p for p in plan.processes if p.role == role][0].argv
    for flag, value in flags.items():
        assert flag in line
        if value is not True:
            assert line[line.index(flag) + 1] == str(value)


@pytest.mark.parametrize("target,variable,flags", [
    ("h200-pd-1node", "VLLM_ALLOW_LONG_MAX_MODEL_LEN", {"--max-model-len": 2097152}),
    ("sglang-h200-low-latency", "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN",
     {"--context-length": 2097152}),
])
def test_the_engines_own_escape_hatch_lifts_the_context_limit(target, variable, flags):
    role = "decode" if target == "h200-pd-1node" else "worker"
    with pytest.raises(PlanError):
        make_plan(target, None, {"args": {role: flags}})
    plan = make_plan(target, None, {"args": {role: flags}, "env": {role: {variable: "1"}}})
    assert "2097152" in [p for p in plan.processes if p.role == role][0].argv


def test_limits_name_real_flags_of_the_engine():
    catalog = cat.load()
    for name, engine in catalog.engines.items():
        for program, limits in engine.limits.items():
            table = engine_flags.table(_table_key(name, program))
            flags = [*limits.flags, *limits.aliases, *limits.aliases.values(),
                     *[f for r in limits.relations for f in (r.flag, r.ge or r.multiple_of)]]
            for flag in flags:
                assert flag in table, f"engines.{name}.limits.{program}: {flag} is not a flag"
            for rel in limits.relations:
                if rel.when:
                    assert any(f in table for f in rel.when), rel


def test_every_catalog_target_is_within_its_engines_limits(monkeypatch):
    """The catalog's own values pass the checks the operator's do (AMD targets too, with
    the refusal of their runtime left out: test_rules covers it)."""
    monkeypatch.setattr(rules, "RULES",
                        [r for r in rules.RULES if r is not rules.venv_runtime_needs_nvidia])
    for name in sorted(cat.load().targets):
        make_plan(name)
