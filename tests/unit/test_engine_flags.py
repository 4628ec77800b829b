"""Every rendered command line parses with the pinned engines' real flag tables,
and the checker itself catches what the real parsers reject."""

from __future__ import annotations

import pytest

from gpufleet import catalog as cat
from gpufleet import engine_flags
from gpufleet.plan import make_plan

OPTION_CASES = [("sglang-h200-low-latency", o) for o in ("hicache", "cp", "dflash2", "fp8-kv")]
OPTION_CASES.append(("sglang-h200-pd", "layer-split"))


@pytest.mark.parametrize("target", sorted(cat.load().targets))
def test_every_target_renders_accepted_flags(target):
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
    (["vllm", "serve", "m", "--no-disable-hybrid-kv-cache-manager"], "unknown flag"),
    (["vllm-router", "--policy", "fastest"], "'fastest' is not one of"),
    (["python3", "-m", "sglang.launch_server", "--tp", "8"], "unknown flag --tp"),
    (["python3", "-m", "sglang.launch_server", "--kv-cache-dtype", "fp8"], "is not one of"),
    (["python3", "-m", "dynamo.frontend", "--router-mode", "kv-aware"], "is not one of"),
    (["python3", "-m", "dynamo.vllm", "--dyn-reasoning-parser", "glm99"], "is not one of"),
    (["python3", "-m", "sglang_router.launch_router", "--pd"], "unknown flag --pd"),
])
def test_checker_rejects_what_the_real_parser_rejects(argv, problem):
    problems = engine_flags.check(argv)
    assert any(problem in p for p in problems), problems


def test_help_parser_reads_choices_and_nargs():
    t = engine_flags.table("vllm-router")
    assert t["--vllm-pd-disaggregation"]["nargs"] == 0
    assert t["--prefill"]["nargs"] == "+"
    assert "round_robin" in t["--policy"]["choices"]
    assert "--kv-events" in engine_flags.table("dynamo.frontend")  # an alias on one line
