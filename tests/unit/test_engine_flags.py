"""Every rendered command line parses with the pinned engines' real flag tables,
and the checker itself catches what the real parsers reject."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpufleet import catalog as cat
from gpufleet import engine_flags, rules
from gpufleet.catalog import lockfile
from gpufleet.plan import make_plan

REPO = Path(__file__).resolve().parents[2]
OPTION_CASES = [("sglang-h200-low-latency", o) for o in ("hicache", "cp", "dflash2", "fp8-kv")]
OPTION_CASES.append(("sglang-h200-pd", "layer-split"))


@pytest.mark.parametrize("target", sorted(cat.load().targets))
def test_every_target_renders_accepted_flags(target, monkeypatch):
    # AMD targets are refused whole (no ROCm engine build to install: test_rules); their
    # command lines are rendered and checked here with that one rule left out
    monkeypatch.setattr(rules, "RULES",
                        [r for r in rules.RULES if r is not rules.venv_runtime_needs_nvidia])
    plan = make_plan(target)
    for p in plan.processes:
        if p.role not in ("etcd", "gateway"):  # Debian's binaries, no engine table
            assert engine_flags.program_of(p.argv)[0], p.argv
        assert engine_flags.check(p.argv) == [], (p.name, p.argv)


@pytest.mark.parametrize("target,option", OPTION_CASES)
def test_options_render_accepted_flags(target, option):
    for p in make_plan(target, None, {"options": [option]}).processes:
        assert engine_flags.check(p.argv) == []


@pytest.mark.parametrize("argv,problem", [
    (["vllm", "serve", "m", "--tensor-parallel-sise", "4"], "unknown flag --tensor-parallel-sise"),
    (["vllm", "serve", "m", "--speculative-config", "{method: mtp}"], "not valid JSON"),
    (["vllm", "serve", "m", "--port"], "--port needs a value"),
    (["vllm", "serve", "m", "extra"], "unexpected argument 'extra'"),
    # --no- only before a boolean switch: not a flag that takes a value, not a lone
    # store_true switch, not twice; SGLang's table lists every --no- form it takes
    (["vllm", "serve", "m", "--no-max-num-seqs"], "unknown flag --no-max-num-seqs"),
    (["vllm", "serve", "m", "--no-headless"], "unknown flag --no-headless"),
    (["vllm", "serve", "m", "--no-disable-log-stats"], "unknown flag --no-disable-log-stats"),
    (["vllm", "serve", "m", "--no-no-enforce-eager"], "unknown flag --no-no-enforce-eager"),
    (["vllm", "serve", "m", "--no-enable-prefix-caching", "x"], "unexpected argument 'x'"),
    (["python3", "-m", "sglang.launch_server", "--no-enable-metrics"], "unknown flag"),
    (["vllm-router", "--policy", "fastest"], "'fastest' is not one of"),
    (["python3", "-m", "sglang.launch_server", "--tp", "8"], "unknown flag --tp"),
    (["python3", "-m", "sglang.launch_server", "--kv-cache-dtype", "fp8"], "is not one of"),
    (["python3", "-m", "dynamo.frontend", "--router-mode", "kv-aware"], "is not one of"),
    (["python3", "-m", "dynamo.vllm", "--dyn-reasoning-parser", "glm99"], "is not one of"),
    (["python3", "-m", "sglang_router.launch_router", "--pd"], "unknown flag --pd"),
    # Dynamo's workers run vLLM 0.31.0, which has no --disable-prefix-caching (0.33.0 does)
    (["python3", "-m", "dynamo.vllm", "--disable-prefix-caching"],
     "(vLLM 0.31.0): unknown flag --disable-prefix-caching"),
])
def test_checker_rejects_what_the_real_parser_rejects(argv, problem):
    problems = engine_flags.check(argv)
    assert any(problem in p for p in problems), problems


@pytest.mark.parametrize("argv", [
    # 000's spelling: the hybrid KV cache manager on
    ["vllm", "serve", "m", "--no-disable-hybrid-kv-cache-manager"],
    ["vllm", "serve", "m", "--no-enable-prefix-caching"],          # prefix caching off
    ["vllm", "serve", "m", "--no-enforce-eager", "--port", "8000"],  # listed in the table
    ["python3", "-m", "dynamo.vllm", "--no-disable-hybrid-kv-cache-manager"],
    ["python3", "-m", "dynamo.vllm", "--no-enable-prefix-caching"],
    ["vllm", "serve", "m", "--disable-prefix-caching"],
])
def test_checker_takes_the_no_forms_the_real_parser_takes(argv):
    assert engine_flags.check(argv) == []


def test_no_forms_are_derived_from_enable_disable_pairs_only():
    listed = {"--enable-x": {"nargs": 0}, "--disable-x": {"nargs": 0},
              "--headless": {"nargs": 0}, "--enable-y": {"nargs": None},
              "--disable-y": {"nargs": None}, "--enable-z": {"choices": None}}
    assert engine_flags.negations(listed) == {
        "--no-enable-x": {"nargs": 0}, "--no-disable-x": {"nargs": 0}}
    assert engine_flags.negations(
        engine_flags.table("sglang.launch_server")) == {}  # no nargs recorded there


def test_help_parser_reads_choices_and_nargs():
    t = engine_flags.table("vllm-router")
    assert t["--vllm-pd-disaggregation"]["nargs"] == 0
    assert t["--prefill"]["nargs"] == "+"
    assert "round_robin" in t["--policy"]["choices"]
    assert "--kv-events" in engine_flags.table("dynamo.frontend")  # an alias on one line


def test_each_program_is_checked_against_the_version_its_lock_installs():
    """vllm serve: the vllm lock's vLLM; dynamo.vllm: the vLLM that ai-dynamo 1.6.1's
    `vllm` extra installs (the Dynamo lock's), whatever the vllm engine pins."""
    for program, engine in (("vllm serve", "vllm"), ("dynamo.vllm", "dynamo")):
        lock = lockfile.read(REPO / cat.load().lock_path(engine, "x86_64", "3.12"))
        version = lock.pins["vllm"][0]
        tables = engine_flags.PROGRAMS[program][1]
        assert f"vllm-{version}-serve-flags.json" in tables, (program, version, tables)
        assert f"vLLM {version}" in engine_flags.PROGRAMS[program][0]


def test_the_dynamo_stand_in_ships_every_table_its_checker_reads():
    """The lab's Dynamo wheel vendors engine_flags with the tables of `dynamo.vllm`: one
    it lacks is a worker that cannot start (FileNotFoundError in the dry parse)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "dynamo_build", Path(__file__).resolve().parents[2] / "lab" / "dynamo" / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    reads = set(engine_flags.PROGRAMS["dynamo.vllm"][1]) | set(
        engine_flags.WITHOUT.get("dynamo.vllm", ()))
    assert reads <= set(build.TABLES)
